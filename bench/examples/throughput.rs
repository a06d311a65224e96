//! End-to-end throughput of the host, and what the WASM sandbox costs per delivery.
//!
//! Run: `scripts/bench-core.sh` (release build, pgbench's seed transaction beside it), or
//! `cargo run --release -p idemhost-bench --example throughput -- --n 20000 --in-flight 1,16`.
//! `scripts/bench-languages.sh` runs it with `--handler wasm:inventory-py,...` (any component in
//! plugins/dist) and `--languages`, which measures each language's load and per-delivery costs.
//!
//! For each `max_in_flight`, with the WASM inventory plugin and then the native handler, it
//! resets a `bench_throughput` schema (1,000 SKUs), publishes N OrderPlaced events to a fresh
//! stream, starts the host, and times until the durable consumer has nothing pending or
//! unacknowledged; then it checks by SQL that markers == N and the reserved sum == N. Then,
//! without NATS, it times single deliveries through the claim pipeline to isolate the plugin's
//! instantiate+call cost. Logging is off (as a benchmark, not as a default).

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use idemhost::{
    ClaimSettings, Claimer, HandleFuture, Handler, Host, Isolation, Message, PluginLimits,
    PluginRuntime, TxHandle,
};
use idemhost_bench::NativeInventory;

use idemhost_bench::examples::*;

struct Args {
    n: usize,
    in_flight: Vec<u32>,
    /// `native`, `wasm` (the Rust inventory component) or `wasm:<component name>`.
    handlers: Vec<String>,
    plugin_dir: String,
    /// Measure load and per-delivery costs of every language's inventory component.
    languages: bool,
}

fn args() -> Args {
    let mut a = Args {
        n: 20_000,
        in_flight: vec![1, 16],
        handlers: vec!["wasm".into(), "native".into()],
        plugin_dir: concat!(env!("CARGO_MANIFEST_DIR"), "/../plugins/dist").into(),
        languages: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--languages" {
            a.languages = true;
            continue;
        }
        let value = it.next().unwrap_or_default();
        match flag.as_str() {
            "--n" => a.n = value.parse().unwrap_or(a.n),
            "--in-flight" => {
                a.in_flight = value.split(',').filter_map(|s| s.parse().ok()).collect()
            }
            "--handler" => a.handlers = value.split(',').map(str::to_string).collect(),
            "--plugin-dir" => a.plugin_dir = value,
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

async fn end_to_end(
    args: &Args,
    handler: &str,
    in_flight: u32,
    js: &jetstream::Context,
) -> serde_json::Value {
    let pool = reset_schema().await.expect("the bench schema");
    publish_all(js, args.n).await.expect("the bench stream");
    let component = match handler {
        "wasm" => Some("inventory"),
        other => other.strip_prefix("wasm:"),
    };
    let plugin = component.map(|name| format!("{}/{name}.wasm", args.plugin_dir));
    let mut host = Host::new(config(in_flight, plugin, "").expect("the bench config"));
    if handler == "native" {
        host = host.with_handler(CONSUMER, Arc::new(NativeInventory));
    }
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let cpu0 = cpu_time();
    let started = Instant::now();
    let task = tokio::spawn(
        host.run(idemhost::RunOptions { migrate: false }, async move {
            let _ = stop_rx.await;
        }),
    );
    // The clock starts at the first acked delivery (plugin compilation and binding are
    // start-up, not throughput) and counts the deliveries acked after it.
    let stream = js.get_stream("BENCH").await.unwrap();
    let mut first: Option<(Instant, usize)> = None;
    loop {
        tokio::time::sleep(Duration::from_millis(5)).await;
        if let Ok(info) = stream.consumer_info(CONSUMER).await {
            let acked = info.ack_floor.stream_sequence as usize;
            if first.is_none() && acked > 0 {
                first = Some((Instant::now(), acked));
            }
            if info.num_pending == 0 && info.num_ack_pending == 0 && acked >= args.n {
                break;
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "bench did not finish in 10 minutes"
        );
    }
    let (t0, acked0) = first.unwrap_or((started, 0));
    let seconds = t0.elapsed().as_secs_f64();
    let counted = args.n - acked0;
    let cpu = (cpu_time() - cpu0).as_secs_f64();
    let _ = stop_tx.send(());
    task.await.unwrap().unwrap();
    let markers: i64 = sqlx::query_scalar("SELECT count(*) FROM processed_message")
        .fetch_one(&pool)
        .await
        .unwrap();
    let reserved: i64 = sqlx::query_scalar("SELECT sum(reserved)::bigint FROM inventory")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(markers as usize, args.n, "markers == N");
    assert_eq!(reserved as usize, args.n, "reserved sum == N");
    let per_second = counted as f64 / seconds;
    println!(
        "{handler:<7} max_in_flight={in_flight:<3} n={} {seconds:>7.2}s {per_second:>8.0} msg/s  cpu {:.0} µs/msg (markers and effects verified)",
        args.n,
        cpu / args.n as f64 * 1e6
    );
    pool.close().await;
    serde_json::json!({"handler": handler, "max_in_flight": in_flight, "n": args.n, "seconds": seconds, "per_second": per_second, "cpu_us_per_msg": cpu / args.n as f64 * 1e6})
}

/// A handler that does nothing: the claim pipeline's own cost.
struct Noop;
impl Handler for Noop {
    fn handle<'a>(&'a self, _tx: &'a TxHandle, _msg: &'a Message) -> HandleFuture<'a> {
        Box::pin(async { Ok(()) })
    }
    fn describe(&self) -> String {
        "noop".into()
    }
}

async fn p50_us(c: &Claimer, h: &dyn Handler, tag: &str, payload: &str, rounds: usize) -> f64 {
    let mut times = Vec::with_capacity(rounds);
    for i in 0..rounds {
        let id = format!("{tag}-{i}");
        let msg = Message {
            id,
            subject: "bench.orders".into(),
            event_type: None,
            headers: vec![],
            payload: payload.as_bytes().to_vec().into(),
            delivery_attempt: 1,
        };
        let t = Instant::now();
        let p = c.process(h, &msg).await;
        times.push(t.elapsed().as_secs_f64() * 1e6);
        assert_eq!(p.outcome, idemhost::Outcome::Applied, "{p:?}");
    }
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

async fn per_delivery_overhead(args: &Args) -> serde_json::Value {
    let pool = reset_schema().await.expect("the bench schema");
    let rt = PluginRuntime::new().unwrap();
    let limits = PluginLimits {
        timeout: Duration::from_secs(5),
        memory: 64 << 20,
    };
    let inventory = rt
        .load(
            format!("{}/inventory.wasm", args.plugin_dir).as_ref(),
            limits,
        )
        .unwrap();
    let testkit = rt
        .load(format!("{}/testkit.wasm", args.plugin_dir).as_ref(), limits)
        .unwrap();
    let c = Claimer::new(
        pool.clone(),
        ClaimSettings::new(CONSUMER, Isolation::ReadCommitted),
    );
    let order = r#"{"id":"x","orderId":"o","sku":"sku-7","quantity":1}"#;
    let rounds = 2000;
    // Warm up the connection and statement caches.
    p50_us(&c, &Noop, "warm", "", 200).await;
    let noop_native = p50_us(&c, &Noop, "nn", "", rounds).await;
    let noop_wasm = p50_us(&c, &testkit, "nw", r#"{"steps":[]}"#, rounds).await;
    let inv_native = p50_us(&c, &NativeInventory, "in", order, rounds).await;
    let inv_wasm = p50_us(&c, &inventory, "iw", order, rounds).await;
    println!(
        "claim pipeline p50 per delivery (one connection, {rounds} each): empty handler native {noop_native:.0} µs, \
         wasm {noop_wasm:.0} µs (instantiate+call ≈ {:.0} µs); inventory native {inv_native:.0} µs, wasm {inv_wasm:.0} µs",
        noop_wasm - noop_native
    );
    println!(
        "inventory component: {} bytes, testkit component: {} bytes",
        inventory.size(),
        testkit.size()
    );
    pool.close().await;
    serde_json::json!({"p50_us": {"noop_native": noop_native, "noop_wasm": noop_wasm, "wasm_overhead": noop_wasm - noop_native,
        "inventory_native": inv_native, "inventory_wasm": inv_wasm}, "component_bytes": inventory.size()})
}

/// Per language: component size, compile time (cold, and from the compile cache), and the p50
/// of instantiation and of the `handle` call over 2,000 inventory deliveries on one connection.
async fn language_costs(args: &Args) -> serde_json::Value {
    let pool = reset_schema().await.expect("the bench schema");
    let c = Claimer::new(
        pool.clone(),
        ClaimSettings::new(CONSUMER, Isolation::ReadCommitted),
    );
    let limits = PluginLimits {
        timeout: Duration::from_secs(5),
        memory: 64 << 20,
    };
    let cache = std::env::temp_dir().join(format!("idemhost-bench-cache-{}", std::process::id()));
    let mut out = Vec::new();
    for name in ["inventory", "inventory-py", "inventory-js", "inventory-c"] {
        let path = format!("{}/{name}.wasm", args.plugin_dir);
        let _ = std::fs::remove_dir_all(&cache);
        let mut rt = PluginRuntime::new().unwrap();
        rt.set_compile_cache(Some(&cache)).unwrap();
        let cold = rt.load(path.as_ref(), limits).unwrap();
        let cached = rt.load(path.as_ref(), limits).unwrap();
        assert!(cached.load_info().from_cache);
        let order = r#"{"id":"x","orderId":"o","sku":"sku-7","quantity":1}"#;
        p50_us(&c, &cached, &format!("{name}-warm"), order, 100).await;
        cached.timings().instantiate.reset();
        cached.timings().handle.reset();
        let total = p50_us(&c, &cached, name, order, 2000).await;
        let us = |d: Option<Duration>| d.map(|d| d.as_secs_f64() * 1e6).unwrap_or(0.0);
        let row = serde_json::json!({
            "component": name,
            "bytes": cold.size(),
            "compile_ms": cold.load_info().compile_time.as_secs_f64() * 1e3,
            "cached_load_ms": cached.load_info().compile_time.as_secs_f64() * 1e3,
            "instantiate_p50_us": us(cached.timings().instantiate.quantile(0.5)),
            "handle_p50_us": us(cached.timings().handle.quantile(0.5)),
            "delivery_p50_us": total,
            "wasi_imports": cold.load_info().wasi_imports,
        });
        println!("{row}");
        out.push(row);
    }
    let _ = std::fs::remove_dir_all(&cache);
    pool.close().await;
    serde_json::Value::Array(out)
}

#[tokio::main]
async fn main() {
    let args = args();
    let client = async_nats::connect(NATS_URL).await.unwrap();
    let js = jetstream::new(client);
    let mut runs = Vec::new();
    for &c in &args.in_flight {
        for h in &args.handlers {
            runs.push(end_to_end(&args, h, c, &js).await);
        }
    }
    let overhead = per_delivery_overhead(&args).await;
    let languages = if args.languages {
        Some(language_costs(&args).await)
    } else {
        None
    };
    let _ = js.delete_stream("BENCH").await;
    let _ = js.delete_stream("BENCH_DLQ").await;
    println!("peak RSS {:.0} MiB", peak_rss_mib());
    println!(
        "{}",
        serde_json::json!({"runs": runs, "overhead": overhead, "languages": languages, "peak_rss_mib": peak_rss_mib()})
    );
}
