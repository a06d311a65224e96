//! The paced latency run of `idemhost bench`: a steady publish rate at half the peak, each
//! message timed from just before its publish to its ack seen on the wire, and pgbench at the
//! same rate beside it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use async_nats::jetstream;
use futures::StreamExt;

use super::{
    BenchOptions, CONSUMER, HostRun, STREAM, SUBJECT, dead_letter_stream, default_mode,
    host_config, mode_config, order, peers, publish, reset, start_host, verify,
};
use idemhost::Host;

/// The paced runs: the default configuration at half its peak (the target's figure). When the
/// default is group commit, also per message (WASM) at half its own peak and group commit at
/// that same rate, under `at_per_message_load`: the same load both ways. `None` when skipped.
pub(super) async fn runs(
    o: &BenchOptions,
    db_url: &str,
    (client, js): (&async_nats::Client, &jetstream::Context),
    c: u32,
    runs: &[HostRun],
) -> anyhow::Result<Option<serde_json::Value>> {
    let peak = |mode: &str| {
        runs.iter()
            .filter(|r| r.mode == mode)
            .map(|r| r.per_second)
            .fold(0.0, f64::max)
    };
    let default = default_mode(o, runs);
    if o.latency_seconds == 0 || peak(default) <= 0.0 {
        return Ok(None);
    }
    let settings = mode_config(o, default, c);
    let mut main = paced(
        o,
        db_url,
        client,
        js,
        c,
        peak(default) / 2.0,
        default,
        &settings,
    )
    .await?;
    let per_message_rate = peak("wasm") / 2.0;
    if default != "wasm" && per_message_rate > 0.0 {
        let wasm = mode_config(o, "wasm", c);
        let per_message = paced(o, db_url, client, js, c, per_message_rate, "wasm", &wasm).await?;
        let grouped = paced(
            o,
            db_url,
            client,
            js,
            c,
            per_message_rate,
            default,
            &settings,
        )
        .await?;
        main["at_per_message_load"] =
            serde_json::json!({ "per_message": per_message, "default": grouped });
    }
    Ok(Some(main))
}

/// Publishes at `rate` per second for `latency_seconds` while the host (WASM, `c` in flight,
/// the consumer `settings` of run `mode`) consumes, and measures each message from just before
/// its publish to its ack seen on the wire (`$JS.ACK.<stream>.<consumer>...`, the host's
/// double-ack request).
#[allow(clippy::too_many_arguments)]
pub(super) async fn paced(
    o: &BenchOptions,
    db_url: &str,
    client: &async_nats::Client,
    js: &jetstream::Context,
    c: u32,
    rate: f64,
    mode: &str,
    settings: &str,
) -> anyhow::Result<serde_json::Value> {
    reset(db_url).await?;
    dead_letter_stream(js).await?;
    publish(js, "", 0, 0.0, SUBJECT, STREAM).await?;
    let total = ((rate * f64::from(o.latency_seconds)) as usize).max(10);
    let acks: Arc<Mutex<HashMap<u64, Instant>>> = Arc::default();
    let mut sub = client
        .subscribe(format!("$JS.ACK.{STREAM}.{CONSUMER}.>"))
        .await?;
    let seen = acks.clone();
    let observer = tokio::spawn(async move {
        while let Some(m) = sub.next().await {
            let at = Instant::now();
            let body = m.payload.as_ref();
            if !(body.is_empty() || body.starts_with(b"+ACK")) {
                continue;
            }
            let tokens: Vec<&str> = m.subject.split('.').collect();
            // v1: $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>...; v2 adds domain and account.
            let seq = if tokens.len() >= 12 {
                tokens.get(7)
            } else {
                tokens.get(5)
            };
            if let Some(seq) = seq.and_then(|s| s.parse::<u64>().ok())
                && let Ok(mut acks) = seen.lock()
            {
                acks.entry(seq).or_insert(at);
            }
        }
    });
    let (stop, task) = start_host(Host::new(host_config(db_url, o, 1, settings)?));
    // Let the host bind its consumer before the clock starts.
    let stream = js.get_stream(STREAM).await?;
    let bound = Instant::now();
    while stream.consumer_info(CONSUMER).await.is_err() {
        if bound.elapsed() > Duration::from_secs(60) {
            bail!("the host did not bind its consumer");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A few deliveries first, not timed: the host opens its connections and makes its plugin
    // instances on its first deliveries; the steady rate is what is measured.
    let warm_up = (c as usize * 4).max(10);
    for i in 0..warm_up {
        let (headers, payload) = order(total + i);
        js.publish_with_headers(SUBJECT, headers, payload.into_bytes().into())
            .await?
            .await?;
    }
    while acks.lock().map(|a| a.len()).unwrap_or(0) < warm_up {
        if bound.elapsed() > Duration::from_secs(120) {
            bail!("the host did not ack the warm-up messages");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let sent: Arc<Mutex<HashMap<u64, Instant>>> = Arc::default();
    let start = tokio::time::Instant::now();
    let mut pending = Vec::new();
    for i in 0..total {
        tokio::time::sleep_until(start + Duration::from_secs_f64(i as f64 / rate)).await;
        let (headers, payload) = order(i);
        let at = Instant::now();
        let ack = js
            .publish_with_headers(SUBJECT, headers, payload.into_bytes().into())
            .await?;
        let sent = sent.clone();
        pending.push(tokio::spawn(async move {
            if let Ok(a) = ack.await
                && let Ok(mut s) = sent.lock()
            {
                s.insert(a.sequence, at);
            }
        }));
    }
    for p in pending {
        let _ = p.await;
    }
    let waited = Instant::now();
    loop {
        let done = acks.lock().map(|a| a.len()).unwrap_or(0);
        if done >= warm_up + total || waited.elapsed() > Duration::from_secs(60) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = stop.send(());
    task.await??;
    observer.abort();
    verify(db_url, warm_up + total)
        .await
        .context("latency run")?;
    let sent = sent.lock().map(|s| s.clone()).unwrap_or_default();
    let acks = acks.lock().map(|a| a.clone()).unwrap_or_default();
    let mut ms: Vec<f64> = sent
        .iter()
        .filter_map(|(seq, t0)| {
            acks.get(seq)
                .map(|t1| t1.duration_since(*t0).as_secs_f64() * 1e3)
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    if ms.len() < total {
        bail!("latency run: {} of {total} acks observed", ms.len());
    }
    let q = |p: f64| ms[((ms.len() as f64 * p) as usize).min(ms.len() - 1)];
    println!(
        "latency of {mode} at {rate:.0} msg/s, c={c}: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms over {total} messages",
        q(0.5),
        q(0.99),
        ms[ms.len() - 1]
    );
    let mut report = serde_json::json!({"mode": mode, "rate": rate, "concurrency": c, "messages": total,
        "p50_ms": q(0.5), "p99_ms": q(0.99), "max_ms": ms[ms.len() - 1]});
    // The same transaction at the same rate straight through pgbench: how much of the tail is
    // the database's own.
    reset(db_url).await?;
    match peers::pgbench_paced(db_url, c, rate, o.latency_seconds).await {
        Ok(db) => {
            println!(
                "pgbench at {rate:.0} tps, c={c}: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms over {} transactions (from each one's scheduled start)",
                db.p50_ms, db.p99_ms, db.max_ms, db.transactions
            );
            report["pgbench"] = serde_json::json!({"p50_ms": db.p50_ms, "p99_ms": db.p99_ms,
                "max_ms": db.max_ms, "transactions": db.transactions});
        }
        Err(e) => println!("pgbench at {rate:.0} tps: skipped ({e:#})"),
    }
    Ok(report)
}
