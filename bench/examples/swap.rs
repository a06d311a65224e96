//! What a hot swap costs under load: the host drains N OrderPlaced events with one inventory
//! component and, a third of the way in, is told through its admin API to swap to another
//! (by default the Rust plugin to the Python one: an 18 MB component compiled from scratch,
//! with no compile cache). Prints the deploy call's time (validation), the swap latency (the
//! request to the first delivery on the new version), the throughput before, during and
//! after, and checks by SQL that every message was applied once (markers == reserved == N,
//! each marker's digest one of the two versions).
//!
//! Run: `scripts/bench-swap.sh`, or
//! `cargo run --release -p idemhost-bench --example swap -- --n 20000 --to inventory-py`.

use std::time::{Duration, Instant, SystemTime};

use idemhost::Host;
use idemhost::ops::admin as http;

use idemhost_bench::examples::*;

const TOKEN: &str = "bench-swap-token";

struct Args {
    n: usize,
    in_flight: u32,
    from: String,
    to: String,
    plugin_dir: String,
    /// Keep compiled components between runs (default: compile the new version cold).
    cached: bool,
}

fn args() -> Args {
    let mut a = Args {
        n: 20_000,
        in_flight: 16,
        from: "inventory".into(),
        to: "inventory-py".into(),
        plugin_dir: concat!(env!("CARGO_MANIFEST_DIR"), "/../plugins/dist").into(),
        cached: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--cached" {
            a.cached = true;
            continue;
        }
        let value = it.next().unwrap_or_default();
        match flag.as_str() {
            "--n" => a.n = value.parse().unwrap_or(a.n),
            "--in-flight" => a.in_flight = value.parse().unwrap_or(a.in_flight),
            "--from" => a.from = value,
            "--to" => a.to = value,
            "--plugin-dir" => a.plugin_dir = value,
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

fn secs(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

#[tokio::main]
async fn main() {
    let args = args();
    let to = format!("{}/{}.wasm", args.plugin_dir, args.to);
    if args.cached {
        // What `idemhost plugin check new.wasm` does before a deploy: compile into the default
        // compile cache, so the host's validation only reads the compiled code back.
        let mut rt = idemhost::PluginRuntime::new().unwrap();
        let dir = idemhost::config::default_compile_cache_dir().expect("a compile cache directory");
        rt.set_compile_cache(Some(&dir)).unwrap();
        let limits = idemhost::PluginLimits {
            timeout: Duration::from_secs(5),
            memory: 64 << 20,
        };
        rt.load(to.as_ref(), limits).unwrap();
    }
    let client = async_nats::connect(NATS_URL).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let pool = reset_schema().await.expect("the bench schema");
    publish_all(&js, args.n).await.expect("the bench stream");

    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();
    let cache = if args.cached {
        ""
    } else {
        "compile_cache = \"off\"\n"
    };
    let top = format!(
        "[admin]\nlisten = \"127.0.0.1:{port}\"\ntoken = \"{TOKEN}\"\n[host]\n{cache}[plugins]\nwatch = false\n"
    );
    let from = format!("{}/{}.wasm", args.plugin_dir, args.from);
    let host = Host::new(config(args.in_flight, Some(from), &top).expect("the bench config"));
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(
        host.run(idemhost::RunOptions { migrate: false }, async move {
            let _ = stop_rx.await;
        }),
    );
    let count = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM processed_message")
            .fetch_one(&pool)
            .await
            .unwrap() as usize
    };
    let started = Instant::now();
    while count().await < args.n / 3 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(started.elapsed() < Duration::from_secs(600), "no progress");
    }

    let component = std::fs::read(&to).unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let requested = SystemTime::now();
    let auth = format!("Bearer {TOKEN}");
    let answer = http::request_ok(
        "POST",
        &format!("{base}/plugins?consumer={CONSUMER}"),
        &[("Authorization", &auth)],
        &component,
        Duration::from_secs(300),
    )
    .await
    .unwrap();
    let answered = SystemTime::now();
    while count().await < args.n {
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "did not finish"
        );
    }
    let report: serde_json::Value = serde_json::from_str(
        &http::get(&format!("{base}/plugins"), Duration::from_secs(5))
            .await
            .unwrap(),
    )
    .unwrap();
    let _ = stop_tx.send(());
    task.await.unwrap().unwrap();

    // Exactly once, by SQL.
    let scalar = |sql: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let markers = scalar("SELECT count(*) FROM processed_message").await;
    let reserved = scalar("SELECT sum(reserved)::bigint FROM inventory").await;
    let versions =
        scalar("SELECT count(DISTINCT plugin_digest) FROM processed_message_handler").await;
    let recorded = scalar("SELECT count(*) FROM processed_message_handler").await;
    assert_eq!(markers as usize, args.n, "markers == N");
    assert_eq!(reserved as usize, args.n, "reserved sum == N");
    assert_eq!(recorded as usize, args.n, "a digest per marker");
    assert_eq!(
        versions, 2,
        "both versions applied messages (if the new one applied none, the swap took longer than \
         the rest of the run: raise --n)"
    );

    let buckets: Vec<(f64, i64)> = sqlx::query_as(
        "SELECT (floor(extract(epoch FROM processed_at) * 10) / 10)::float8, count(*) \
         FROM processed_message GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let rate = |from: f64, to: f64| {
        let n: i64 = buckets
            .iter()
            .filter(|(b, _)| *b >= from && *b < to)
            .map(|(_, n)| n)
            .sum();
        n as f64 / (to - from).max(0.1)
    };
    let (t_req, t_ans) = (secs(requested), secs(answered));
    let last = buckets.last().map(|(b, _)| *b).unwrap_or(t_ans);
    let before = rate(t_req - 2.0, t_req);
    let during = rate(t_req, t_ans.max(t_req + 0.1));
    let after = rate(t_ans + 0.2, (t_ans + 2.2).min(last));
    let current = &report["consumers"][0]["current"];
    let answer: serde_json::Value = serde_json::from_str(&answer).unwrap();
    let validation = answer["validation_ms"].as_f64().unwrap_or(0.0);
    let latency = current["swap_latency_ms"].as_f64().unwrap_or(f64::NAN);
    println!(
        "swap {} -> {} ({} bytes{}) under load, n={} max_in_flight={}",
        args.from,
        args.to,
        component.len(),
        if args.cached {
            ", compile cache"
        } else {
            ", compiled cold"
        },
        args.n,
        args.in_flight
    );
    println!(
        "  deploy call            {:>8.1} ms (validation {validation:.1} ms)",
        (t_ans - t_req) * 1e3
    );
    println!(
        "  swap latency           {latency:>8.1} ms (request -> first delivery on the new version)"
    );
    println!("  throughput before      {before:>8.0} msg/s (2 s before the request)");
    println!(
        "  throughput during      {during:>8.0} msg/s (while validating: {:+.0}%)",
        (during / before - 1.0) * 100.0
    );
    println!("  throughput after       {after:>8.0} msg/s (2 s after)");
    println!("  verified: markers == reserved == {markers}, 2 digests recorded");
    println!(
        "{}",
        serde_json::json!({"from": args.from, "to": args.to, "bytes": component.len(), "cached": args.cached,
            "n": args.n, "max_in_flight": args.in_flight, "deploy_call_ms": (t_ans - t_req) * 1e3,
            "validation_ms": validation, "swap_latency_ms": latency, "before_per_s": before,
            "during_per_s": during, "after_per_s": after, "peak_rss_mib": peak_rss_mib()})
    );
}
