//! What ships in `deploy/` against the binary it ships with: the Kubernetes manifests (their
//! configuration parses with the variables the Deployment sets, the container ports are the
//! listeners', the grace period outlasts `host.shutdown_timeout`, the arguments are a command
//! the binary takes, the plugin path is one the image holds), and the metric and label names of
//! the Grafana dashboard and the Prometheus alert rules. Whether those names, and the probes'
//! paths, exist on a live host is `operations::the_shipped_dashboard_alerts_and_probes_match_a_live_host`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;
use yaml_serde::Value;

use crate::common::*;

/// The YAML documents of a file under `deploy/`.
fn yaml_documents(path: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(repo_root().join(path)).unwrap();
    yaml_serde::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).unwrap_or_else(|e| panic!("{path}: {e}")))
        .collect()
}

fn get<'a>(value: &'a Value, path: &[&str]) -> &'a Value {
    path.iter().fold(value, |v, key| {
        v.get(*key)
            .unwrap_or_else(|| panic!("no {key} in {path:?}: {v:?}"))
    })
}

fn str_of<'a>(value: &'a Value, path: &[&str]) -> &'a str {
    get(value, path)
        .as_str()
        .unwrap_or_else(|| panic!("{path:?} is not a string"))
}

/// The manifests by kind.
fn manifests() -> BTreeMap<String, Value> {
    yaml_documents("deploy/kubernetes/idemhost.yaml")
        .into_iter()
        .map(|doc| (str_of(&doc, &["kind"]).to_string(), doc))
        .collect()
}

/// The Deployment's one container.
fn container(manifests: &BTreeMap<String, Value>) -> &Value {
    let containers = get(
        &manifests["Deployment"],
        &["spec", "template", "spec", "containers"],
    );
    &containers.as_sequence().unwrap()[0]
}

/// The configuration the pod runs: the ConfigMap's file with the Deployment's variables (their
/// values from the Secret), parsed and validated by the host's own loader.
pub(crate) fn kubernetes_config() -> idemhost::Config {
    let m = manifests();
    let text = str_of(&m["ConfigMap"], &["data", "idemhost.toml"]);
    let secret = get(&m["Secret"], &["stringData"]);
    let mut env = Vec::new();
    for var in get(container(&m), &["env"]).as_sequence().unwrap() {
        let name = str_of(var, &["name"]).to_string();
        let value = match var.get("value") {
            Some(v) => v.as_str().unwrap().to_string(),
            None => {
                let key = str_of(var, &["valueFrom", "secretKeyRef", "key"]);
                assert_eq!(
                    str_of(var, &["valueFrom", "secretKeyRef", "name"]),
                    str_of(&m["Secret"], &["metadata", "name"])
                );
                str_of(secret, &[key]).to_string()
            }
        };
        env.push((name, value));
    }
    assert_eq!(
        idemhost::config::unread_overrides(env.clone()),
        Vec::<String>::new(),
        "every variable is one the host reads"
    );
    idemhost::Config::from_toml(
        text,
        env,
        Path::new("deploy/kubernetes/idemhost.yaml"),
        Path::new("/etc/idemhost"),
    )
    .unwrap_or_else(|e| panic!("the ConfigMap's idemhost.toml: {e}"))
}

/// The probes' paths on the admin port, as the kubelet would ask them.
pub(crate) fn kubernetes_probe_paths() -> Vec<String> {
    let m = manifests();
    let c = container(&m);
    ["startupProbe", "livenessProbe", "readinessProbe"]
        .iter()
        .map(|probe| str_of(c, &[probe, "httpGet", "path"]).to_string())
        .collect()
}

fn port_of(listen: &Option<String>) -> u64 {
    let listen = listen.as_deref().expect("a listener");
    listen.rsplit(':').next().unwrap().parse().unwrap()
}

#[test]
fn the_kubernetes_manifests_match_the_binary() {
    let config = kubernetes_config();
    let m = manifests();
    let c = container(&m);
    let ports: BTreeMap<&str, u64> = get(c, &["ports"])
        .as_sequence()
        .unwrap()
        .iter()
        .map(|p| {
            (
                str_of(p, &["name"]),
                get(p, &["containerPort"]).as_u64().unwrap(),
            )
        })
        .collect();
    // Only the metrics listener is exposed: it answers the probes and the scrapes and can
    // neither list nor deploy plugins; the admin endpoint stays on the pod's loopback.
    assert_eq!(
        ports.keys().copied().collect::<Vec<_>>(),
        ["metrics"],
        "exposed ports"
    );
    assert_eq!(ports["metrics"], port_of(&config.metrics.listen));
    // The kubelet reaches the pod's address, not its loopback.
    let metrics_listen = config.metrics.listen.as_deref().unwrap();
    assert!(metrics_listen.starts_with("0.0.0.0:"), "{metrics_listen}");
    let admin_listen = config.admin.listen.as_deref().unwrap_or("127.0.0.1:0");
    assert!(admin_listen.starts_with("127.0.0.1:"), "{admin_listen}");
    for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
        let port = str_of(c, &[probe, "httpGet", "port"]);
        assert_eq!(port, "metrics", "{probe} names port {port}");
    }
    // Liveness must not follow the database: an outage would restart every replica.
    assert_eq!(str_of(c, &["livenessProbe", "httpGet", "path"]), "/healthz");
    assert_eq!(str_of(c, &["readinessProbe", "httpGet", "path"]), "/readyz");

    // The memory limit covers SECURITY.md's stated bound (a delivery: its plugin's
    // memory_limit plus 96 MiB) for every delivery in flight, plus the process's own; else a
    // plugin within its bound gets the pod, bystanders included, OOM-killed.
    let limit = get(c, &["resources", "limits", "memory"]).as_str().unwrap();
    let limit_bytes: u64 = match limit.strip_suffix("Gi") {
        Some(n) => n.parse::<u64>().unwrap() << 30,
        None => limit.strip_suffix("Mi").unwrap().parse::<u64>().unwrap() << 20,
    };
    let bound: u64 = config
        .consumers
        .iter()
        .map(|c| u64::from(c.max_in_flight) * (c.memory_limit.0 + (96 << 20)))
        .sum::<u64>()
        + (128 << 20);
    assert!(
        limit_bytes >= bound,
        "memory limit {limit} under the bound {bound} bytes"
    );
    // The memory alert fires below that limit.
    let alerts =
        std::fs::read_to_string(repo_root().join("deploy/prometheus/idemhost-alerts.yaml"))
            .unwrap();
    let threshold_gib: f64 = alerts
        .lines()
        .find_map(|l| {
            l.split("process_resident_memory_bytes{job=\"idemhost\"} > ")
                .nth(1)
        })
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .expect("the memory alert's threshold");
    assert!(
        threshold_gib * f64::from(1u32 << 30) < limit_bytes as f64,
        "memory alert at {threshold_gib} GiB does not fire below the {limit} limit"
    );

    let service_port = &get(&m["Service"], &["spec", "ports"])
        .as_sequence()
        .unwrap()[0];
    assert_eq!(str_of(service_port, &["targetPort"]), "metrics");
    assert_eq!(
        str_of(
            &m["Service"],
            &["metadata", "annotations", "prometheus.io/port"]
        ),
        port_of(&config.metrics.listen).to_string()
    );

    let grace = get(
        &m["Deployment"],
        &["spec", "template", "spec", "terminationGracePeriodSeconds"],
    )
    .as_u64()
    .unwrap();
    assert!(
        Duration::from_secs(grace) > config.host.shutdown_timeout.0 + Duration::from_secs(5),
        "terminationGracePeriodSeconds {grace} must outlast host.shutdown_timeout {:?}",
        config.host.shutdown_timeout.0
    );

    // The plugin is one the image holds; the compile cache is a mounted, writable volume.
    let containerfile = std::fs::read_to_string(repo_root().join("Containerfile")).unwrap();
    for consumer in &config.consumers {
        let plugin = consumer
            .plugin
            .as_ref()
            .expect("a plugin file")
            .display()
            .to_string();
        assert!(
            containerfile
                .lines()
                .any(|l| l.starts_with("COPY ") && l.ends_with(&format!(" {plugin}"))),
            "the image has no {plugin}"
        );
    }
    let mounts: BTreeMap<&str, bool> = get(c, &["volumeMounts"])
        .as_sequence()
        .unwrap()
        .iter()
        .map(|v| {
            let read_only = v.get("readOnly").and_then(Value::as_bool).unwrap_or(false);
            (str_of(v, &["mountPath"]), read_only)
        })
        .collect();
    let cache = config
        .host
        .compile_cache_dir()
        .expect("a compile cache")
        .display()
        .to_string();
    assert_eq!(
        mounts.get(cache.as_str()),
        Some(&false),
        "compile cache {cache}"
    );
    assert_eq!(mounts.get("/etc/idemhost"), Some(&true));

    // The arguments are a command line the binary accepts.
    let args: Vec<&str> = get(c, &["args"])
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let out = run_ok(
        std::process::Command::new(env!("CARGO_BIN_EXE_idemhost"))
            .args(&args)
            .arg("--help"),
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("--config"));
}

/// The metric names (`idemhost_…`, `process_…`, `up`) and label names an expression uses:
/// identifiers outside string literals, the names before a matcher's operator, inside
/// `by (…)` / `without (…)` / `on (…)` / `ignoring (…)`, and `label_values(metric, label)`.
pub(crate) fn promql_names(expr: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let mut metrics = BTreeSet::new();
    let mut labels = BTreeSet::new();
    // Tokens: identifiers, string literals (dropped), single characters.
    let mut tokens: Vec<String> = Vec::new();
    let mut chars = expr.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '"' || c == '\'' || c == '`' {
            let mut escaped = false;
            for d in chars.by_ref() {
                if !escaped && d == c {
                    break;
                }
                escaped = !escaped && d == '\\';
            }
            tokens.push("\"\"".into());
        } else if c.is_ascii_alphabetic() || c == '_' || c == '$' {
            let mut ident = c.to_string();
            while let Some(&d) = chars.peek() {
                if d.is_ascii_alphanumeric() || d == '_' || d == ':' {
                    ident.push(d);
                    chars.next();
                } else {
                    break;
                }
            }
            tokens.push(ident);
        } else if c.is_ascii_digit() {
            // Numbers and durations (5m) are one token, never a name.
            while chars
                .peek()
                .is_some_and(|d| d.is_ascii_alphanumeric() || *d == '.')
            {
                chars.next();
            }
            tokens.push("0".into());
        } else if c == '[' {
            // A range or a subquery: [$__rate_interval], [5m:1m].
            for d in chars.by_ref() {
                if d == ']' {
                    break;
                }
            }
        } else if !c.is_whitespace() {
            tokens.push(c.to_string());
        }
    }
    let mut depth_braces = 0;
    let mut grouping = false;
    for (i, t) in tokens.iter().enumerate() {
        let next = tokens.get(i + 1).map(String::as_str);
        match t.as_str() {
            "{" => depth_braces += 1,
            "}" => depth_braces -= 1,
            "(" | ")" if grouping => grouping = t == "(",
            "by" | "without" | "on" | "ignoring" | "group_left" | "group_right" => {
                grouping = next == Some("(");
            }
            name if name.starts_with('$') || name == "\"\"" || name == "0" => {}
            name if (depth_braces > 0 || grouping)
                && name
                    .chars()
                    .next()
                    .is_some_and(|c| c.is_ascii_alphabetic() || c == '_') =>
            {
                labels.insert(name.to_string());
            }
            name if name.starts_with("idemhost_")
                || name.starts_with("process_")
                || name == "up" =>
            {
                metrics.insert(name.to_string());
            }
            "label_values" => {
                // label_values(metric, label): the last identifier before `)`.
                if let Some(label) = tokens[i..]
                    .iter()
                    .take_while(|t| *t != ")")
                    .filter(|t| t.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
                    .nth(2)
                {
                    labels.insert(label.clone());
                }
            }
            _ => {}
        }
    }
    (metrics, labels)
}

/// Every PromQL expression the dashboard and the alert rules hold, with where it is.
pub(crate) fn shipped_expressions() -> Vec<(String, String)> {
    let mut found = Vec::new();
    let path = "deploy/grafana/idemhost-dashboard.json";
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(repo_root().join(path)).unwrap()).unwrap();
    fn walk(v: &serde_json::Value, at: &str, found: &mut Vec<(String, String)>) {
        match v {
            serde_json::Value::Object(map) => {
                let title = map.get("title").and_then(|t| t.as_str()).unwrap_or(at);
                for (key, value) in map {
                    match (key.as_str(), value) {
                        ("expr", serde_json::Value::String(e)) => {
                            found.push((title.into(), e.clone()))
                        }
                        ("query" | "definition", serde_json::Value::String(e))
                            if e.contains("label_values") =>
                        {
                            found.push((title.into(), e.clone()))
                        }
                        _ => walk(value, title, found),
                    }
                }
            }
            serde_json::Value::Array(items) => items.iter().for_each(|i| walk(i, at, found)),
            _ => {}
        }
    }
    walk(&dashboard, path, &mut found);
    for doc in yaml_documents("deploy/prometheus/idemhost-alerts.yaml") {
        for group in get(&doc, &["groups"]).as_sequence().unwrap() {
            for rule in get(group, &["rules"]).as_sequence().unwrap() {
                let name = str_of(rule, &["alert"]);
                found.push((format!("alert {name}"), str_of(rule, &["expr"]).to_string()));
            }
        }
    }
    found
}

/// The names come out of every shape the files use, and nothing from inside strings or ranges.
#[test]
fn promql_names_are_read_from_every_shape() {
    let (m, l) = promql_names(
        r#"histogram_quantile(0.99, sum by (consumer, le) (rate(idemhost_x_bucket{consumer=~"$c", outcome!="idemhost_in_string"}[$__rate_interval])))
           / on (instance) group_left process_max_fds > 1.5 * 1024 and up{job="idemhost"} == 0"#,
    );
    let set = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    assert_eq!(m, set(&["idemhost_x_bucket", "process_max_fds", "up"]));
    assert_eq!(l, set(&["consumer", "le", "outcome", "instance", "job"]));
    let (m, l) = promql_names("label_values(idemhost_deliveries_total, consumer)");
    assert_eq!(m, set(&["idemhost_deliveries_total"]));
    assert_eq!(l, set(&["consumer"]));
    assert!(shipped_expressions().len() > 20);
}

/// The license the packages declare is the one in LICENSE, and the upgrade notes cover every
/// migration the binary carries (a new migration without a note fails here).
#[test]
fn license_and_upgrade_notes_cover_what_ships() {
    let root = repo_root();
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    assert!(manifest.contains("license = \"Apache-2.0\""));
    let license = std::fs::read_to_string(root.join("LICENSE")).unwrap();
    assert!(
        license.contains("Apache License") && license.contains("Version 2.0, January 2004"),
        "LICENSE is not the Apache License 2.0"
    );
    let notes = std::fs::read_to_string(root.join("docs/upgrading.md")).unwrap();
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(root.join("migrations")).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().to_string();
        let stem = name.trim_end_matches(".sql");
        if !notes.contains(&format!("| `{stem}` |")) {
            missing.push(stem.to_string());
        }
    }
    assert!(
        missing.is_empty(),
        "docs/upgrading.md has no note for {missing:?}"
    );
}

/// The demo servers `compose.servers.yaml` adds have no passwords: they are published on the
/// host's loopback only, never on its network (they were on `network_mode: host`, PostgreSQL
/// trusting every address).
#[test]
fn compose_servers_are_reachable_from_this_machine_only() {
    let doc = &yaml_documents("compose.servers.yaml")[0];
    for name in ["postgres", "nats"] {
        let service = get(doc, &["services", name]);
        assert!(
            service.get("network_mode").is_none(),
            "{name} on the host's network"
        );
        let ports = get(service, &["ports"]).as_sequence().unwrap();
        assert!(!ports.is_empty());
        for port in ports {
            let port = port.as_str().unwrap();
            assert!(port.starts_with("127.0.0.1:"), "{name} publishes {port}");
        }
    }
}
