//! `postgres.url`: the servers it names (several for failover, and the session each must
//! offer), and the URL with its password masked for logs and errors.

/// Which session a server must offer to be used (`target_session_attrs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SessionAttrs {
    /// The first server that accepts a connection (libpq's default).
    Any,
    /// A server whose sessions can write: not a standby, `default_transaction_read_only` off.
    ReadWrite,
    /// A server that is not in recovery (a primary, even one set read-only by default).
    Primary,
}

/// The servers of a `postgres.url`: one URL per host, in the order given.
#[derive(Debug, Clone)]
pub(crate) struct Servers {
    urls: Vec<String>,
    hosts: Vec<(String, u16)>,
    attrs: SessionAttrs,
}

impl Servers {
    /// Parses `url`: its host part may list `host:port` pairs separated by commas, and its query
    /// may carry `target_session_attrs` (`read-write` — the default with several servers —,
    /// `primary`, or `any` with one server; the host writes, so `read-only`, `standby` and
    /// `prefer-standby` are refused). Everything else is kept as is for each host.
    pub(crate) fn parse(url: &str) -> anyhow::Result<Servers> {
        let shown = || redact_url(url);
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| anyhow::anyhow!("invalid postgres.url {}: no scheme", shown()))?;
        let end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        let (userinfo, host_list) = match authority.rfind('@') {
            Some(at) => (&authority[..=at], &authority[at + 1..]),
            None => ("", authority),
        };
        let (path, query) = tail.split_once('?').unwrap_or((tail, ""));
        let mut attrs = None;
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            if key != "target_session_attrs" {
                kept.push(pair);
                continue;
            }
            attrs = Some(match value {
                "any" => SessionAttrs::Any,
                "read-write" => SessionAttrs::ReadWrite,
                "primary" => SessionAttrs::Primary,
                other => anyhow::bail!(
                    "invalid postgres.url {}: target_session_attrs={other} is not supported \
                     (the host writes: any, read-write or primary)",
                    shown()
                ),
            });
        }
        let query = if kept.is_empty() {
            String::new()
        } else {
            format!("?{}", kept.join("&"))
        };
        let mut urls = Vec::new();
        let mut hosts = Vec::new();
        for host in host_list.split(',') {
            if host.is_empty() {
                anyhow::bail!(
                    "invalid postgres.url {}: an empty host in its list",
                    shown()
                );
            }
            let one = format!("{scheme}://{userinfo}{host}{path}{query}");
            let parsed = url::Url::parse(&one)
                .map_err(|e| anyhow::anyhow!("invalid postgres.url {}: {e}", shown()))?;
            let name = parsed.host_str().unwrap_or_default();
            // `Url` keeps an IPv6 address in brackets; PostgreSQL wants it bare.
            let name = name
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string();
            hosts.push((name, parsed.port().unwrap_or(5432)));
            urls.push(one);
        }
        // The host writes: of several servers it needs the writable one. `any` would settle
        // on a standby the first time the primary is slow, and stay there.
        let attrs = match (attrs, hosts.len()) {
            (Some(SessionAttrs::Any), n) if n > 1 => anyhow::bail!(
                "invalid postgres.url {}: target_session_attrs=any with several servers could \
                 settle on a standby (use read-write or primary, the default)",
                shown()
            ),
            (Some(attrs), _) => attrs,
            (None, 1) => SessionAttrs::Any,
            (None, _) => SessionAttrs::ReadWrite,
        };
        Ok(Servers { urls, hosts, attrs })
    }

    /// The URL of server `i`: its one host, without `target_session_attrs`.
    pub(crate) fn url(&self, i: usize) -> &str {
        &self.urls[i]
    }

    pub(crate) fn len(&self) -> usize {
        self.urls.len()
    }

    pub(crate) fn attrs(&self) -> SessionAttrs {
        self.attrs
    }

    /// The host name and port of server `i`.
    pub(crate) fn host(&self, i: usize) -> (&str, u16) {
        let (name, port) = &self.hosts[i];
        (name, *port)
    }

    /// Whether the host must keep asking which server to use: more than one to choose from, or
    /// one that must keep offering a kind of session.
    pub(crate) fn watched(&self) -> bool {
        self.len() > 1 || self.attrs != SessionAttrs::Any
    }
}

/// A URL with its password replaced by `***`, for error messages and logs: the one in its
/// user part and a `password=` query parameter.
pub fn redact_url(raw: &str) -> String {
    if let Ok(mut u) = url::Url::parse(raw) {
        if u.password().is_some() {
            // Setting a password only fails for URLs that cannot have one.
            let _ = u.set_password(Some("***"));
        }
        return redact_query_password(u.as_ref());
    }
    // Several hosts (`h1:5432,h2:5432`) are not a URL to the `url` crate, nor is a password
    // with an unencoded `/` in it: by hand, then, masking all from `user:` to the last `@`.
    let Some((scheme, rest)) = raw.split_once("://") else {
        return "<unparseable url>".to_string();
    };
    let redacted = match rest.rfind('@') {
        Some(at) => {
            let user = rest[..at].split([':', '/', '?']).next().unwrap_or_default();
            let password = if rest[..at].len() > user.len() {
                ":***"
            } else {
                ""
            };
            format!("{scheme}://{user}{password}{}", &rest[at..])
        }
        None => raw.to_string(),
    };
    redact_query_password(&redacted)
}

/// `password=…` query parameters replaced by `password=***`.
fn redact_query_password(url: &str) -> String {
    let Some((base, query)) = url.split_once('?') else {
        return url.to_string();
    };
    let pairs: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((key, _)) if key.eq_ignore_ascii_case("password") => format!("{key}=***"),
            _ => pair.to_string(),
        })
        .collect();
    format!("{base}?{}", pairs.join("&"))
}

/// [`redact_url`] of each URL of a comma-separated list (`nats.url` of a cluster).
pub fn redact_urls(list: &str) -> String {
    list.split(',')
        .map(|u| redact_url(u.trim()))
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_list_becomes_one_url_per_host_in_order() {
        let s = Servers::parse(
            "postgres://app:secret@db1:5433,db2,[::1]:6000/orders?sslmode=disable&target_session_attrs=read-write&application_name=x",
        )
        .unwrap();
        assert_eq!(s.len(), 3);
        assert_eq!(s.attrs(), SessionAttrs::ReadWrite);
        assert_eq!(
            s.url(0),
            "postgres://app:secret@db1:5433/orders?sslmode=disable&application_name=x"
        );
        assert_eq!(
            s.url(1),
            "postgres://app:secret@db2/orders?sslmode=disable&application_name=x"
        );
        assert_eq!(s.hosts[1], ("db2".to_string(), 5432));
        assert_eq!(s.hosts[2], ("::1".to_string(), 6000));
        assert!(s.watched());
    }

    #[test]
    fn one_host_without_attributes_is_not_watched() {
        let s = Servers::parse("postgres://root@127.0.0.1:5432/test").unwrap();
        assert_eq!(s.len(), 1);
        assert_eq!(s.url(0), "postgres://root@127.0.0.1:5432/test");
        assert!(!s.watched());
        let s = Servers::parse("postgres://root@h/test?target_session_attrs=primary").unwrap();
        assert_eq!(s.url(0), "postgres://root@h/test");
        assert!(s.watched());
    }

    #[test]
    fn attributes_the_host_cannot_use_and_empty_hosts_are_refused() {
        let s = Servers::parse("postgres://u@a,b/db").unwrap();
        assert_eq!(
            s.attrs(),
            SessionAttrs::ReadWrite,
            "several servers: read-write"
        );
        for bad in [
            "postgres://u@a,b/db?target_session_attrs=any",
            "postgres://u@a,b/db?target_session_attrs=standby",
            "postgres://u@a,b/db?target_session_attrs=read-only",
            "postgres://u@a,,b/db",
            "postgres://u@a:notaport,b/db",
            "no-scheme",
        ] {
            assert!(Servers::parse(bad).is_err(), "{bad}");
        }
        let err = Servers::parse("postgres://u:pw@a,b/db?target_session_attrs=standby")
            .unwrap_err()
            .to_string();
        assert!(!err.contains("pw"), "password shown: {err}");
    }

    #[test]
    fn a_host_list_is_redacted_too() {
        assert_eq!(
            redact_url("postgres://app:secret@db1:5433,db2:5432/orders?target_session_attrs=any"),
            "postgres://app:***@db1:5433,db2:5432/orders?target_session_attrs=any"
        );
        assert_eq!(
            redact_url("postgres://app@db1,db2/orders"),
            "postgres://app@db1,db2/orders"
        );
        for leaky in [
            "postgres://app:pa/ss@db1,db2/orders",
            "postgres://app:pa/ss@db1/orders",
            "postgres://app@db1,db2/orders?password=secret&sslmode=require",
            "postgres://app@db1/orders?password=secret",
            "postgres://app:a@b,c@db1,db2/orders",
        ] {
            let shown = redact_url(leaky);
            for secret in ["pa/ss", "secret", "a@b,c"] {
                assert!(!shown.contains(secret), "{leaky} shown as {shown}");
            }
        }
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact_url("postgres://app:s3cret@db:5432/x"),
            "postgres://app:***@db:5432/x"
        );
        assert_eq!(redact_url("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
    }
}
