//! Parsing, overrides and validation of the configuration, with errors that name the key.

use super::*;

const SAMPLE: &str = r#"
    [nats]
    url = "nats://127.0.0.1:4222"
    [admin]
    listen = "127.0.0.1:9464"
    [postgres]
    url = "postgres://root@127.0.0.1:5432/test"
    [[consumer]]
    name = "inventory-reservation-v1"
    stream = "ORDERS"
    subjects = ["orders.placed"]
    plugin = "plugins/inventory.wasm"
    isolation = "serializable"
    backoff = ["100ms", "1s"]
    memory_limit = "32MiB"
"#;

fn parse(text: &str, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
    let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string()));
    Config::from_toml(
        text,
        env,
        Path::new("test.toml"),
        Path::new("/etc/idemhost"),
    )
}

#[test]
fn sample_parses_with_defaults() {
    let c = parse(SAMPLE, &[]).unwrap();
    let con = &c.consumers[0];
    assert_eq!(con.isolation, Isolation::Serializable);
    assert_eq!(con.memory_limit, ByteSize(32 << 20));
    assert_eq!(con.max_in_flight, 16);
    assert_eq!(con.backoff_for(1), Duration::from_millis(100));
    assert_eq!(con.backoff_for(9), Duration::from_secs(1));
    assert_eq!(
        con.plugin.as_deref(),
        Some(Path::new("/etc/idemhost/plugins/inventory.wasm"))
    );
    assert_eq!(con.dead_letter_subject(), "dlq.inventory-reservation-v1");
    assert_eq!(con.statement_timeout(), Duration::from_secs(5));
}

/// `host.compile_cache`: a relative path resolves against the config's directory, `"off"`
/// disables it (also from the environment), and the default is the user's cache directory.
#[test]
fn compile_cache_resolves_or_turns_off() {
    let with = |value: &str| {
        SAMPLE.replace(
            "[postgres]",
            &format!("[host]\ncompile_cache = \"{value}\"\n[postgres]"),
        )
    };
    let c = parse(&with("cache/components"), &[]).unwrap();
    assert_eq!(
        c.host.compile_cache_dir().as_deref(),
        Some(Path::new("/etc/idemhost/cache/components"))
    );
    assert_eq!(
        parse(&with("off"), &[]).unwrap().host.compile_cache_dir(),
        None
    );
    let off_by_env = parse(SAMPLE, &[("IDEMHOST_HOST__COMPILE_CACHE", "off")]).unwrap();
    assert_eq!(off_by_env.host.compile_cache_dir(), None);
    let default = parse(SAMPLE, &[]).unwrap().host.compile_cache_dir();
    assert_eq!(default, default_compile_cache_dir());
}

#[test]
fn env_overrides_reach_nested_and_listed_keys() {
    let c = parse(
        SAMPLE,
        &[
            ("IDEMHOST_POSTGRES__URL", "postgres://app@db/app"),
            ("IDEMHOST_CONSUMER__0__MAX_IN_FLIGHT", "4"),
            ("IDEMHOST_CONSUMER__0__HANDLER_TIMEOUT", "250ms"),
            ("IDEMHOST_LOG", "ignored: no double underscore"),
        ],
    )
    .unwrap();
    assert_eq!(c.postgres.url, "postgres://app@db/app");
    assert_eq!(c.consumers[0].max_in_flight, 4);
    assert_eq!(
        c.consumers[0].handler_timeout,
        HumanDuration(Duration::from_millis(250))
    );
}

#[test]
fn errors_name_the_key() {
    let err = parse(
        &SAMPLE.replace("isolation = \"serializable\"", "isolation = \"chaos\""),
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("isolation") || err.contains("chaos"), "{err}");
    let err = parse(
        &SAMPLE.replace("memory_limit = \"32MiB\"", "memory_limit = \"lots\""),
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("invalid size \"lots\""), "{err}");
    let err = parse(&format!("{SAMPLE}\nmax_in_flight = 0\n"), &[])
        .unwrap_err()
        .to_string();
    assert!(err.contains("consumer[0].max_in_flight"), "{err}");
    let err = parse(&format!("{SAMPLE}\nsurprise = 1\n"), &[])
        .unwrap_err()
        .to_string();
    assert!(err.contains("surprise"), "{err}");
    let err = parse(
        &SAMPLE.replace("[postgres]", "[host]\nlog_format = \"xml\"\n[postgres]"),
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("log_format") && err.contains("unknown variant `xml`"),
        "{err}"
    );
    for (extra, key) in [
        ("role = \"Robert'); DROP\"", "consumer[0].role"),
        (
            "ordering = { key = \"payload:/x\" }",
            "consumer[0].ordering.key",
        ),
        ("effect_query = \"SELECT 1\"", "consumer[0].effect_query"),
    ] {
        let err = parse(&format!("{SAMPLE}\n{extra}\n"), &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains(key), "{extra}: {err}");
    }
    let c = parse(
        &format!(
            "{SAMPLE}\nrole = \"inventory_plugin\"\nordering = {{ key = \"json:/orderId\" }}\n"
        ),
        &[],
    )
    .unwrap();
    assert_eq!(c.consumers[0].role.as_deref(), Some("inventory_plugin"));
    let err = parse(SAMPLE, &[("IDEMHOST_CONSUMER__3__NAME", "x")])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("IDEMHOST_CONSUMER__3__NAME") && err.contains("out of range"),
        "{err}"
    );
}

#[test]
fn hot_swap_keys_have_defaults_and_are_validated() {
    let c = parse(SAMPLE, &[]).unwrap();
    assert!(c.plugins.watch && c.plugins.store.is_none());
    assert_eq!(c.plugins.watch_interval.0, Duration::from_secs(1));
    assert_eq!(c.plugins.version_bucket, "idemhost-plugin-versions");
    assert_eq!(c.admin.token, None);
    assert_eq!(c.admin.max_upload.0, 128 << 20);
    let with = |top: &str| SAMPLE.replace("[postgres]", &format!("{top}\n[postgres]"));
    let c = parse(
        &with("[plugins]\nstore = \"nats\"\nhistory = 4"),
        &[("IDEMHOST_ADMIN__TOKEN", "s3cret")],
    )
    .unwrap();
    assert_eq!(c.plugins.store, Some(PluginStoreKind::Nats));
    assert_eq!(c.admin.token.as_deref(), Some("s3cret"));
    for (top, key) in [
        ("[plugins]\nhistory = 0", "plugins.history"),
        (
            "[plugins]\nversion_bucket = \"a.b\"",
            "plugins.version_bucket",
        ),
        (
            "[plugins]\nwatch_interval = \"1ms\"",
            "plugins.watch_interval",
        ),
        ("[plugins]\nstore = \"s3\"", "store"),
    ] {
        let err = parse(&with(top), &[]).unwrap_err().to_string();
        assert!(err.contains(key), "{top}: {err}");
    }
    let err = parse(SAMPLE, &[("IDEMHOST_ADMIN__TOKEN", " ")])
        .unwrap_err()
        .to_string();
    assert!(err.contains("admin.token"), "{err}");
    // With the shared store, the consumer name keys the KV pointer.
    let odd = with("[plugins]\nstore = \"nats\"").replace("inventory-reservation-v1", "inv:v1");
    let err = parse(&odd, &[]).unwrap_err().to_string();
    assert!(
        err.contains("consumer[0].name") && err.contains("KV key"),
        "{err}"
    );
    assert!(is_kv_key("inventory-reservation-v1") && !is_kv_key(".x") && !is_kv_key("a b"));
}

/// `host.replica` and `host.replicas` come together (from the environment too, as a
/// StatefulSet sets them), the replica numbered below the count.
#[test]
fn a_replicas_place_is_both_keys_and_in_range() {
    let both = parse(
        SAMPLE,
        &[
            ("IDEMHOST_HOST__REPLICA", "2"),
            ("IDEMHOST_HOST__REPLICAS", "3"),
        ],
    )
    .unwrap();
    assert_eq!((both.host.replica, both.host.replicas), (Some(2), Some(3)));
    let none = parse(SAMPLE, &[]).unwrap();
    assert_eq!((none.host.replica, none.host.replicas), (None, None));
    for (env, key) in [
        (&[("IDEMHOST_HOST__REPLICA", "0")][..], "host.replicas"),
        (&[("IDEMHOST_HOST__REPLICAS", "3")][..], "host.replica"),
        (
            &[
                ("IDEMHOST_HOST__REPLICA", "3"),
                ("IDEMHOST_HOST__REPLICAS", "3"),
            ][..],
            "host.replica",
        ),
        (
            &[
                ("IDEMHOST_HOST__REPLICA", "0"),
                ("IDEMHOST_HOST__REPLICAS", "0"),
            ][..],
            "host.replicas",
        ),
        (
            &[
                ("IDEMHOST_HOST__REPLICA", "0"),
                ("IDEMHOST_HOST__REPLICAS", "1001"),
            ][..],
            "host.replicas",
        ),
        (
            &[
                ("IDEMHOST_HOST__REPLICA", "-1"),
                ("IDEMHOST_HOST__REPLICAS", "3"),
            ][..],
            "replica",
        ),
    ] {
        let err = parse(SAMPLE, env).unwrap_err().to_string();
        assert!(err.contains(key), "{env:?}: {err}");
    }
}

/// `partitions` needs one subject with `*` tokens for the key; a host list in `postgres.url`
/// must be one the host can use; each refusal names its key and shows no password.
#[test]
fn partitions_and_server_lists_are_checked() {
    let partitioned = |subject: &str, n: u32| {
        SAMPLE
            .replace("[\"orders.placed\"]", subject)
            .replace("memory_limit", &format!("partitions = {n}\nmemory_limit"))
    };
    let ok = parse(&partitioned("[\"orders.*\"]", 8), &[]).unwrap();
    assert_eq!(
        ok.consumers[0].durables(),
        (0..8)
            .map(|p| format!("inventory-reservation-v1-p{p}"))
            .collect::<Vec<_>>()
    );
    for (subject, n) in [
        ("[\"orders.placed\"]", 8),
        ("[\"orders.>\"]", 8),
        ("[\"orders.*\", \"refunds.*\"]", 8),
        ("[\"orders.*\"]", 5000),
    ] {
        let err = parse(&partitioned(subject, n), &[])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("consumer[0].subjects") || err.contains("consumer[0].partitions"),
            "{subject} × {n}: {err}"
        );
    }
    let with_url = |url: &str| SAMPLE.replace("postgres://root@127.0.0.1:5432/test", url);
    parse(
        &with_url("postgres://app@db1:5432,db2:5433/app?target_session_attrs=read-write"),
        &[],
    )
    .unwrap();
    for bad in [
        "postgres://app:pw@db1,db2/app?target_session_attrs=standby",
        "postgres://app:pw@db1,,db2/app",
    ] {
        let err = parse(&with_url(bad), &[]).unwrap_err().to_string();
        assert!(
            err.contains("postgres.url") && !err.contains("pw@"),
            "{err}"
        );
    }
}

/// Group commit is the default: 16 deliveries at most per transaction, no linger, a 50 ms lock
/// wait in a group. A consumer with `ordering` or `partitions` stays per delivery unless told
/// otherwise (and `ordering` refuses groups); an explicit `batch_max = 1` turns groups off.
#[test]
fn group_commit_is_the_default_except_where_order_rules() {
    let c = parse(SAMPLE, &[]).unwrap();
    let con = &c.consumers[0];
    assert_eq!(con.batch_max(), 16);
    assert_eq!(con.batch_linger.0, crate::config::DEFAULT_BATCH_LINGER);
    assert_eq!(con.batch_lock_timeout.0, Duration::from_millis(50));
    let with = |extra: &str| parse(&format!("{SAMPLE}\n{extra}\n"), &[]);
    assert_eq!(with("batch_max = 1").unwrap().consumers[0].batch_max(), 1);
    let ordered = with("ordering = { key = \"json:/orderId\" }").unwrap();
    assert_eq!(ordered.consumers[0].batch_max(), 1);
    let partitioned = |extra: &str| {
        let text = SAMPLE.replace("[\"orders.placed\"]", "[\"orders.*\"]");
        parse(&format!("{text}\npartitions = 4\n{extra}\n"), &[]).unwrap()
    };
    assert_eq!(partitioned("").consumers[0].batch_max(), 1);
    assert_eq!(partitioned("batch_max = 8").consumers[0].batch_max(), 8);
    for (extra, key) in [
        (
            "ordering = { key = \"json:/orderId\" }\nbatch_max = 4",
            "consumer[0].batch_max",
        ),
        ("batch_max = 65", "consumer[0].batch_max"),
        (
            "batch_lock_timeout = \"2h\"",
            "consumer[0].batch_lock_timeout",
        ),
    ] {
        let err = with(extra).unwrap_err().to_string();
        assert!(err.contains(key), "{extra}: {err}");
    }
    let off = with("batch_lock_timeout = \"0s\"").unwrap();
    assert_eq!(
        crate::claim::ClaimSettings::for_consumer(&off.consumers[0]).group_lock_timeout,
        None
    );
}

/// The ```toml blocks of a documentation file, relative to the repository root.
fn toml_blocks(file: &str) -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(file);
    let text = std::fs::read_to_string(&path).unwrap();
    let mut blocks = Vec::new();
    let mut rest = text.as_str();
    while let Some(start) = rest.find("```toml\n") {
        let body = &rest[start + "```toml\n".len()..];
        let end = body.find("```").expect("an unclosed toml block");
        blocks.push(body[..end].to_string());
        rest = &body[end + 3..];
    }
    blocks
}

/// The configuration examples users copy (the README's, and docs/configuration.md's with every
/// key) parse and validate as they are: a renamed or removed key fails here, not for the user.
#[test]
fn documented_examples_parse() {
    for file in ["README.md", "docs/configuration.md"] {
        let blocks = toml_blocks(file);
        assert!(!blocks.is_empty(), "{file} has no toml example");
        for block in blocks {
            if let Err(e) = parse(&block, &[]) {
                panic!("{file}: {e}\n{block}");
            }
        }
    }
}

/// The keys of `pub struct <name>` in `source`: each `pub <field>:`, or the name a
/// `#[serde(rename = "...")]` above it gives.
fn struct_fields(source: &str, name: &str) -> Vec<String> {
    let start = source
        .find(&format!("pub struct {name} {{"))
        .unwrap_or_else(|| panic!("no struct {name}"));
    let body = &source[start..];
    let body = &body[..body.find("\n}\n").expect("an unclosed struct")];
    let mut keys = Vec::new();
    let mut renamed = None;
    for line in body.lines().map(str::trim) {
        if let Some((_, rest)) = line.split_once("rename = \"") {
            renamed = rest.split_once('"').map(|(key, _)| key.to_string());
        } else if let Some((field, _)) = line.strip_prefix("pub ").and_then(|r| r.split_once(':')) {
            keys.push(renamed.take().unwrap_or_else(|| field.to_string()));
        }
    }
    keys
}

/// Every key `config.rs` accepts is in docs/configuration.md's reference, in its own section (a
/// commented-out `# key =` counts): a key added to the code without its documentation fails
/// here. `documented_examples_parse` checks the other way: every documented key is accepted.
#[test]
fn the_reference_documents_every_key() {
    let source = [include_str!("../config.rs"), include_str!("consumer.rs")].concat();
    let reference = format!("\n{}", toml_blocks("docs/configuration.md").join("\n"));
    // Each section's text: from its header to the next one.
    let section = |header: &str| -> String {
        let start = reference
            .find(&format!("\n{header}\n"))
            .unwrap_or_else(|| panic!("docs/configuration.md has no {header} section"));
        let body = &reference[start + header.len() + 2..];
        let end = body.find("\n[").unwrap_or(body.len());
        body[..end].to_string()
    };
    let documented = |text: &str, key: &str| {
        text.lines().any(|line| {
            let line = line.trim_start_matches(['#', ' ']);
            line.starts_with(&format!("{key} =")) || line.contains(&format!(" {key} = "))
        })
    };
    let mut missing = Vec::new();
    for (structure, header) in [
        ("NatsConfig", "[nats]"),
        ("PostgresConfig", "[postgres]"),
        ("AdminConfig", "[admin]"),
        ("PluginsConfig", "[plugins]"),
        ("HostConfig", "[host]"),
        ("OutboxConfig", "[outbox]"),
        ("MetricsConfig", "[metrics]"),
        ("ConsumerConfig", "[[consumer]]"),
        // The inline table `ordering = { key = ..., max_waiting = ... }`.
        ("OrderingConfig", "[[consumer]]"),
    ] {
        let text = section(header);
        let fields = struct_fields(&source, structure);
        assert!(!fields.is_empty(), "{structure} has no fields");
        for field in fields {
            if !documented(&text, &field) {
                missing.push(format!("{header} {field}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "keys missing from docs/configuration.md: {missing:?}"
    );
}

/// A config file that is not there: the path, the cause once (it was printed twice: the
/// message and its source both carried it) and what to do.
#[test]
fn a_missing_config_file_says_so_once_and_what_to_do() {
    let e = Config::load(Path::new("/nonexistent/idemhost.toml")).unwrap_err();
    let shown = format!("{:#}", anyhow::Error::from(e));
    assert!(shown.contains("/nonexistent/idemhost.toml"), "{shown}");
    assert_eq!(shown.matches("os error 2").count(), 1, "{shown}");
    assert!(shown.contains("give --config"), "{shown}");
}

/// A bad value from an override names the variable (with the consumer's index), not the file.
#[test]
fn a_bad_override_names_its_variable() {
    let e = parse(SAMPLE, &[("IDEMHOST_CONSUMER__0__HANDLER_TIMEOUT", "5x")]).unwrap_err();
    match &e {
        ConfigError::Env { var, message } => {
            assert_eq!(var, "IDEMHOST_CONSUMER__0__HANDLER_TIMEOUT", "{e}");
            assert!(message.contains("5x"), "{e}");
        }
        other => panic!("the file was blamed: {other}"),
    }
    let e = parse(SAMPLE, &[("IDEMHOST_NATS__URL", "[1, 2]")]).unwrap_err();
    assert!(
        matches!(&e, ConfigError::Env { var, .. } if var == "IDEMHOST_NATS__URL"),
        "{e}"
    );
}

/// The file's own mistake names its line, even when overrides fill in other keys; a mistyped
/// key gets the nearest known one.
#[test]
fn a_files_mistake_names_its_line_and_a_typo_its_nearest_key() {
    let text = SAMPLE.replace(
        r#"backoff = ["100ms", "1s"]"#,
        r#"backoff = ["100ms", "1x"]"#,
    );
    let text = text.replace(r#"url = "postgres://root@127.0.0.1:5432/test""#, "");
    let e = parse(
        &text,
        &[(
            "IDEMHOST_POSTGRES__URL",
            "postgres://root@127.0.0.1:5432/test",
        )],
    )
    .unwrap_err();
    let shown = e.to_string();
    assert!(matches!(e, ConfigError::Parse { .. }), "{shown}");
    assert!(
        shown.contains("line 14") && shown.contains("consumer.backoff"),
        "{shown}"
    );
    let e = parse(&SAMPLE.replace("memory_limit", "memory_limt"), &[]).unwrap_err();
    let shown = e.to_string();
    assert!(shown.contains("did you mean `memory_limit`?"), "{shown}");
    assert!(shown.contains("line 15"), "{shown}");
    let e = parse(&SAMPLE.replace("memory_limit", "zzz"), &[]).unwrap_err();
    assert!(!e.to_string().contains("did you mean"), "{e}");
}

/// `IDEMHOST_POSTGRES_URL` (one underscore) is not an override: it is named with the spelling
/// that is; other `IDEMHOST_*` variables (the tests', the bench's) are left alone.
#[test]
fn a_variable_with_one_underscore_is_named_not_ignored() {
    let env = [
        "IDEMHOST_POSTGRES_URL",
        "IDEMHOST_CONSUMER_0_MAX_IN_FLIGHT",
        "IDEMHOST_POSTGRES__URL",
        "IDEMHOST_TEST_PG_URL",
        "IDEMHOST_BENCH_NATS_URL",
        "PATH",
    ]
    .map(|v| (v.to_string(), String::new()));
    let warnings = unread_overrides(env);
    assert_eq!(warnings.len(), 2, "{warnings:#?}");
    assert!(
        warnings[0].contains("IDEMHOST_CONSUMER__0_MAX_IN_FLIGHT")
            && warnings[1].contains("(IDEMHOST_POSTGRES__URL)"),
        "{warnings:#?}"
    );
}

#[test]
fn a_consumers_plugin_config_reads_scalars_as_text_and_is_bounded() {
    let c = parse(
        &format!(
            "{SAMPLE}\n    [consumer.config]\n    max_note_bytes = 10000\n    ratio = 0.5\n    \
             beta = true\n    region = \"eu-west\"\n"
        ),
        &[("IDEMHOST_CONSUMER__0__CONFIG__REGION", "us-east")],
    )
    .unwrap();
    let config: Vec<(&str, &str)> = c.consumers[0]
        .config
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    assert_eq!(
        config,
        [
            ("beta", "true"),
            ("max_note_bytes", "10000"),
            ("ratio", "0.5"),
            ("region", "us-east")
        ]
    );
    assert!(parse(SAMPLE, &[]).unwrap().consumers[0].config.is_empty());
    let refused = |table: String| {
        let text = format!("{SAMPLE}\n    [consumer.config]\n{table}");
        match parse(&text, &[]) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("accepted: {table}"),
        }
    };
    for table in [
        "\"a b\" = \"x\"".to_string(),
        "\"\" = \"x\"".to_string(),
        format!("{} = \"x\"", "k".repeat(65)),
        format!("k = \"{}\"", "x".repeat(MAX_PLUGIN_CONFIG_VALUE + 1)),
        (0..=MAX_PLUGIN_CONFIG_ENTRIES)
            .map(|i| format!("k{i} = \"x\"\n"))
            .collect(),
    ] {
        let e = refused(table.clone());
        assert!(e.contains("consumer[0].config"), "{table:.80}: {e}");
    }
    assert!(refused("nested = { a = 1 }".into()).contains("config"));
}

#[test]
fn the_inbox_prefix_is_subject_tokens() {
    let with = |prefix: &str| {
        parse(
            &SAMPLE.replace(
                "url = \"nats://127.0.0.1:4222\"",
                &format!("url = \"nats://127.0.0.1:4222\"\n    inbox_prefix = \"{prefix}\""),
            ),
            &[],
        )
    };
    assert_eq!(
        with("idemhost_inbox.a-1").unwrap().nats.inbox_prefix,
        "idemhost_inbox.a-1"
    );
    assert_eq!(parse(SAMPLE, &[]).unwrap().nats.inbox_prefix, "_INBOX");
    for bad in ["", "a..b", "a.*", "a.>", "$JS", "a b", "a.", ".a"] {
        let e = with(bad).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("nats.inbox_prefix"), "{bad:?}: {e}");
    }
}
