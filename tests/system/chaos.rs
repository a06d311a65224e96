//! Real faults in the middle of a run: private PostgreSQL and NATS servers restarted under load
//! (the machine's shared services stay up), and a duplicate storm. Each ends by proving by SQL
//! that every message applied exactly once and that everything was acked, nothing dead-lettered.

use std::cell::Cell;
use std::future::Future;
use std::time::{Duration, Instant};

use sqlx::postgres::PgPoolOptions;

use crate::common::*;

const NAME: &str = "inventory-reservation-v1";

/// Publishes `n` OrderPlaced for sku-1 with ids `evt-<i>`.
async fn publish_orders(nats: &NatsEnv, n: usize) {
    nats.publish_many((0..n).map(|i| {
        let id = format!("evt-{i}");
        let mut h = async_nats::HeaderMap::new();
        h.insert("Nats-Msg-Id", id.as_str());
        (h, order_payload(&id, "sku-1", 1))
    }))
    .await;
}

/// A private PostgreSQL with the host's tables and stock, and a host config for it.
async fn private_postgres(nats: &NatsEnv) -> (PrivatePostgres, String) {
    let pg = PrivatePostgres::start();
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect(&pg.url())
        .await
        .unwrap();
    idemhost::migrate(&pool, None).await.unwrap();
    sqlx::raw_sql(include_str!(
        "../../examples/order-flow/migrations/0001_inventory.sql"
    ))
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("INSERT INTO inventory VALUES ('sku-1', 1000000, 0)")
        .execute(&pool)
        .await
        .unwrap();
    pool.close().await;
    let text = format!(
        "[nats]\nurl = \"{NATS_URL}\"\n[postgres]\nurl = \"{}\"\nmax_connections = 18\nacquire_timeout = \"1s\"\n\
         [[consumer]]\ntables = [\"*\"]\npublish_subjects = [\">\"]\nname = \"{NAME}\"\nstream = \"{}\"\nsubjects = [\"{}\"]\nplugin = \"{}\"\ndead_letter_subject = \"{}\"\n{PATIENT}\n",
        pg.url(),
        nats.stream,
        nats.subject(),
        plugin_path("inventory").display(),
        nats.dlq(),
    );
    (pg, text)
}

/// `SELECT count(*)`-style scalars from the private server (`None` while it is down).
async fn scalar(pg: &PrivatePostgres, sql: &str) -> Option<i64> {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(2))
        .connect(&pg.url())
        .await
        .ok()?;
    let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_string()))
        .fetch_one(&pool)
        .await
        .ok()?;
    pool.close().await;
    Some(n)
}

/// The end of every fault test: each of the `n` messages applied exactly once (markers and the
/// reserved stock both equal `n`) and nothing dead-lettered.
async fn assert_applied_once(
    markers: Option<i64>,
    reserved: Option<i64>,
    n: usize,
    nats: &NatsEnv,
) {
    assert_eq!(markers, Some(n as i64));
    assert_eq!(reserved, Some(n as i64), "one effect per marker");
    assert!(
        nats.dead_letters().await.is_empty(),
        "nothing dead-lettered"
    );
}

/// Waits until the private server holds at least `at` markers.
async fn wait_for_markers(pg: &PrivatePostgres, at: usize) {
    wait_until(
        Duration::from_secs(240),
        &format!("{at} markers"),
        || async { (scalar(pg, MARKERS).await? >= at as i64).then_some(()) },
    )
    .await;
}

/// How long after a fault ended the host took to commit deliveries again: from now until the
/// marker count (`count`, `None` while unreadable) first rises above its first readable value.
async fn time_to_progress<F, Fut>(count: F) -> Duration
where
    F: Fn() -> Fut,
    Fut: Future<Output = Option<i64>>,
{
    let back = Instant::now();
    let first = Cell::new(None::<i64>);
    wait_until(
        Duration::from_secs(240),
        "progress after the fault",
        || async {
            let n = count().await?;
            let base = *first.get().get_or_insert(n);
            first.set(Some(base));
            (n > base).then_some(())
        },
    )
    .await;
    back.elapsed()
}

/// Retries generous enough to outlast a few seconds of outage without dead-lettering.
const PATIENT: &str =
    "max_in_flight = 16\nmax_deliver = 100\nbackoff = [\"200ms\", \"1s\"]\nack_wait = \"5s\"";

/// Two attempts only: a database outage must not use them up (`postgres.failover_wait`: the
/// deliveries it failed wait for the server and run again uncounted). With
/// `IDEMHOST_TEST_FAILOVER_WAIT=0s` every such failure counts, as it did before, and messages
/// are dead-lettered.
fn two_attempts(text: &str) -> String {
    let wait = std::env::var("IDEMHOST_TEST_FAILOVER_WAIT").unwrap_or_else(|_| "60s".into());
    text.replace("max_deliver = 100", "max_deliver = 2")
        .replace(
            "acquire_timeout = \"1s\"\n",
            &format!("acquire_timeout = \"1s\"\nfailover_wait = \"{wait}\"\n"),
        )
}

/// PostgreSQL stops twice in the middle of 20,000 deliveries — once with an immediate
/// shutdown (no checkpoint, connections cut), once with a fast one — and comes back: in-flight
/// transactions roll back, wait for the server and run again, the pool reconnects, the host
/// keeps running; with `max_deliver = 2`, nothing is dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restarts_mid_run_lose_and_double_nothing() {
    const N: usize = 20_000;
    init_logs();
    let nats = NatsEnv::new("chaos_pg", Duration::from_secs(60)).await;
    let (pg, text) = private_postgres(&nats).await;
    let text = two_attempts(&text);
    publish_orders(&nats, N).await;
    let host = RunningHost::start(idemhost::Host::new(parse_config(&text)));
    let started = Instant::now();
    let mut recoveries = Vec::new();
    for (at, immediate) in [(N / 5, true), (N / 2, false)] {
        wait_for_markers(&pg, at).await;
        if immediate {
            pg.stop_immediate()
        } else {
            pg.stop_fast()
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        pg.start_again();
        recoveries.push(time_to_progress(|| scalar(&pg, MARKERS)).await);
    }
    nats.wait_drained(NAME, Duration::from_secs(300)).await;
    eprintln!(
        "chaos postgres restarts: {N} messages in {:?}; commits resumed {recoveries:?} after each restart",
        started.elapsed()
    );
    host.stop().await;
    let markers = scalar(&pg, "SELECT count(*) FROM processed_message").await;
    let reserved = scalar(&pg, "SELECT reserved FROM inventory").await;
    assert_applied_once(markers, reserved, N, &nats).await;
    nats.cleanup().await;
}

const MARKERS: &str = "SELECT count(*) FROM processed_message";

/// A database outage longer than two attempts take costs no attempt: one delivery at a time
/// (so a redelivery comes round while the server is still down), `max_deliver = 2`, the server
/// down 6 s. Each delivery it failed waits for the server (`postgres.failover_wait`) and runs
/// again uncounted: nothing is dead-lettered, each message applies once. With
/// `IDEMHOST_TEST_FAILOVER_WAIT=0s` (every such failure counts, as before) messages were
/// dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_outage_burns_no_attempts() {
    const N: usize = 60;
    init_logs();
    let nats = NatsEnv::new("chaos_outage", Duration::from_secs(60)).await;
    let (pg, text) = private_postgres(&nats).await;
    let text = two_attempts(&text)
        .replace("max_in_flight = 16", "max_in_flight = 1\nbatch_max = 1")
        .replace("backoff = [\"200ms\", \"1s\"]", "backoff = [\"100ms\"]")
        .replace("acquire_timeout = \"1s\"", "acquire_timeout = \"300ms\"");
    publish_orders(&nats, N).await;
    let host = RunningHost::start(idemhost::Host::new(parse_config(&text)));
    wait_for_markers(&pg, N / 4).await;
    pg.stop_immediate();
    tokio::time::sleep(Duration::from_secs(6)).await;
    pg.start_again();
    nats.wait_drained(NAME, Duration::from_secs(120)).await;
    host.stop().await;
    let markers = scalar(&pg, MARKERS).await;
    let reserved = scalar(&pg, "SELECT reserved FROM inventory").await;
    assert_applied_once(markers, reserved, N, &nats).await;
    nats.cleanup().await;
}

/// The primary dies (immediate shutdown) in the middle of 10,000 deliveries and its streaming
/// standby is promoted. The host was given both servers with `target_session_attrs=read-write`:
/// it moves its pools (its own and the plugin role's) to the new primary and finishes there.
/// Replication is synchronous, so every commit the host acked is on the standby: the new
/// primary's markers and stock prove nothing was lost and nothing applied twice, and with
/// `max_deliver = 2` nothing was dead-lettered while the database moved. Without the
/// host following the primary, no commit ever lands on the standby and the test times out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_standby_takes_over_and_nothing_is_lost_or_doubled() {
    const N: usize = 10_000;
    init_logs();
    let nats = NatsEnv::new("chaos_failover", Duration::from_secs(60)).await;
    let (primary, text) = private_postgres(&nats).await;
    let standby = PrivatePostgres::standby_of(&primary);
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect(&primary.url())
        .await
        .unwrap();
    sqlx::raw_sql("ALTER SYSTEM SET synchronous_standby_names = '*'")
        .execute(&admin)
        .await
        .unwrap();
    sqlx::raw_sql("SELECT pg_reload_conf()")
        .execute(&admin)
        .await
        .unwrap();
    admin.close().await;
    wait_until(Duration::from_secs(30), "a synchronous standby", || async {
        let sync = "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'";
        (scalar(&primary, sync).await? == 1).then_some(())
    })
    .await;
    let both = format!(
        "postgres://idemhost@{},{}/postgres?target_session_attrs=read-write",
        primary.address(),
        standby.address()
    );
    let text = two_attempts(&text.replace(&primary.url(), &both).replace(
        "acquire_timeout = \"1s\"\n",
        "acquire_timeout = \"1s\"\nfailover_check_interval = \"500ms\"\n",
    ));
    publish_orders(&nats, N).await;
    let host = RunningHost::start(idemhost::Host::new(parse_config(&text)));
    let started = Instant::now();
    wait_for_markers(&primary, N / 3).await;
    primary.stop_immediate();
    let failed_at = Instant::now();
    // A failover takes its time to decide: long enough for two attempts to fail.
    tokio::time::sleep(Duration::from_secs(4)).await;
    standby.promote();
    let promoted_in = failed_at.elapsed();
    time_to_progress(|| scalar(&standby, MARKERS)).await;
    let resumed = failed_at.elapsed();
    nats.wait_drained(NAME, Duration::from_secs(300)).await;
    eprintln!(
        "chaos postgres failover: {N} messages in {:?}; the standby was promoted {promoted_in:?} \
         after the primary died, and commits resumed on it {resumed:?} after the primary died",
        started.elapsed()
    );
    host.stop().await;
    let markers = scalar(&standby, MARKERS).await;
    let reserved = scalar(&standby, "SELECT reserved FROM inventory").await;
    assert_applied_once(markers, reserved, N, &nats).await;
    nats.cleanup().await;
}

/// What happens to the private NATS server mid-run.
enum NatsFault {
    /// SIGTERM, 2 s down, started again on the same JetStream file store.
    Restart,
    /// SIGSTOP for 8 s (past `nats.request_timeout`), then SIGCONT.
    Stall,
}

/// `n` deliveries through a private NATS server that suffers `fault` once `fault_at` applied.
async fn nats_fault_mid_run(tag: &str, n: usize, fault_at: usize, fault: NatsFault) {
    let env = TestEnv::new(tag).await;
    env.seed_inventory(&[("sku-1", 1_000_000)]).await;
    let mut server = PrivateNats::start();
    let nats = NatsEnv::at(&server.url(), tag, Duration::from_secs(120)).await;
    let mut cfg = config(&env, &nats, NAME, "inventory", PATIENT);
    cfg.nats.url = server.url();
    publish_orders(&nats, n).await;
    let host = RunningHost::start(idemhost::Host::new(cfg));
    wait_until(
        Duration::from_secs(240),
        &format!("{fault_at} applied"),
        || async { (env.markers(NAME).await >= fault_at as i64).then_some(()) },
    )
    .await;
    let started = Instant::now();
    match fault {
        NatsFault::Restart => {
            server.stop();
            tokio::time::sleep(Duration::from_secs(2)).await;
            server.restart();
        }
        NatsFault::Stall => {
            server.signal(libc::SIGSTOP);
            tokio::time::sleep(Duration::from_secs(8)).await;
            server.signal(libc::SIGCONT);
        }
    }
    let recovery = time_to_progress(|| async { Some(env.markers(NAME).await) }).await;
    let info = nats.wait_drained(NAME, Duration::from_secs(300)).await;
    eprintln!(
        "chaos {tag}: {n} messages in {:?}; commits resumed {recovery:?} after the server came back",
        started.elapsed()
    );
    host.stop().await;
    let (markers, reserved) = (env.markers(NAME).await, env.reserved("sku-1").await);
    assert_applied_once(Some(markers), Some(reserved), n, &nats).await;
    assert_eq!(info.num_ack_pending, 0);
    nats.cleanup().await;
    env.cleanup().await;
}

/// The NATS server restarts (SIGTERM, same JetStream file store) in the middle of 20,000
/// deliveries: the host's client reconnects, the pull loop resumes on the same durable
/// consumer, unconfirmed acks become redeliveries that the markers absorb.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_restart_mid_run_completes_once() {
    nats_fault_mid_run("chaos_nats", 20_000, 20_000 / 3, NatsFault::Restart).await;
}

/// A duplicate storm: 100 ids delivered 300 times each (under fresh broker ids) while 3,000 new
/// ids flow: 3,100 effects, 29,900 duplicates acked, nothing dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_storm_applies_each_id_once() {
    const HOT: usize = 100;
    const REPEATS: usize = 300;
    const FRESH: usize = 3_000;
    let env = TestEnv::new("storm").await;
    env.seed_inventory(&[("sku-1", 1_000_000)]).await;
    let nats = NatsEnv::new("storm", Duration::from_secs(60)).await;
    let host = RunningHost::start(idemhost::Host::new(config(
        &env,
        &nats,
        NAME,
        "inventory",
        "max_in_flight = 16",
    )));
    let key = env.host_key().await;
    let mut messages = Vec::new();
    let mut fresh = 0;
    for round in 0..REPEATS {
        for hot in 0..HOT {
            let id = format!("hot-{hot}");
            let mut h = async_nats::HeaderMap::new();
            h.insert("Nats-Msg-Id", format!("storm-{round}-{hot}").as_str());
            replayed(&mut h, &key, &id);
            messages.push((h, order_payload(&id, "sku-1", 1)));
            if hot % 10 == 0 && fresh < FRESH {
                let id = format!("new-{fresh}");
                fresh += 1;
                let mut h = async_nats::HeaderMap::new();
                h.insert("Nats-Msg-Id", id.as_str());
                messages.push((h, order_payload(&id, "sku-1", 1)));
            }
        }
    }
    let started = Instant::now();
    nats.publish_many(messages).await;
    nats.wait_drained(NAME, Duration::from_secs(300)).await;
    eprintln!(
        "chaos duplicate storm: {} deliveries drained {:?} after the first publish",
        HOT * REPEATS + fresh,
        started.elapsed()
    );
    host.stop().await;
    let (markers, reserved) = (env.markers(NAME).await, env.reserved("sku-1").await);
    assert_applied_once(Some(markers), Some(reserved), HOT + fresh, &nats).await;
    nats.cleanup().await;
    env.cleanup().await;
}

/// A stalled PostgreSQL — every server process SIGSTOPped for 8 s, so it neither answers nor
/// closes a connection — in the middle of 5,000 deliveries: new deliveries time out acquiring a
/// connection and are nak'ed, in-flight ones wait (kept alive by in-progress acks) and finish
/// after SIGCONT; nothing is acked before its commit, nothing applies twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_postgres_acks_nothing_wrongly() {
    const N: usize = 5_000;
    let nats = NatsEnv::new("chaos_stall", Duration::from_secs(60)).await;
    let (pg, text) = private_postgres(&nats).await;
    publish_orders(&nats, N).await;
    let host = RunningHost::start(idemhost::Host::new(parse_config(&text)));
    wait_for_markers(&pg, N / 5).await;
    pg.signal_all(libc::SIGSTOP);
    tokio::time::sleep(Duration::from_secs(8)).await;
    let during = nats.consumer_info(NAME).await;
    pg.signal_all(libc::SIGCONT);
    let recovery = time_to_progress(|| scalar(&pg, MARKERS)).await;
    nats.wait_drained(NAME, Duration::from_secs(300)).await;
    eprintln!("chaos postgres stall: commits resumed {recovery:?} after SIGCONT");
    host.stop().await;
    let markers = scalar(&pg, "SELECT count(*) FROM processed_message").await;
    let reserved = scalar(&pg, "SELECT reserved FROM inventory").await;
    assert_applied_once(markers, reserved, N, &nats).await;
    assert!(
        during.num_ack_pending > 0,
        "deliveries were held during the stall: {during:?}"
    );
    nats.cleanup().await;
}

/// A stalled NATS server — SIGSTOPped for 8 s, past `nats.request_timeout` — in the middle of
/// 5,000 deliveries: acks time out unconfirmed (the committed deliveries come back as
/// duplicates), pulls fail and back off, and after SIGCONT the run completes exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_nats_completes_once() {
    nats_fault_mid_run("stall_nats", 5_000, 5_000 / 5, NatsFault::Stall).await;
}

/// With `nats.inbox_prefix` the host takes its replies on subjects of its own: a NATS user
/// allowed to subscribe only to `idemhost_inbox.>`, and denied `_INBOX.>` (what an operator
/// denies producers so that none can publish into a pull inbox), runs a consumer to the end —
/// pulls, acks, API requests, dead letters. Before the key every reply came on `_INBOX`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_needs_no_inbox_but_its_own() {
    const N: usize = 50;
    init_logs();
    let server = PrivateNats::start_with(
        "authorization {\n  users = [\n    { user: admin, password: admin }\n    \
         { user: host, password: host, permissions: { publish: \">\", \
         subscribe: { allow: [\"idemhost_inbox.>\"], deny: [\"_INBOX.>\"] } } }\n  ]\n}\n",
    );
    let admin = server.url().replace("nats://", "nats://admin:admin@");
    let nats = NatsEnv::at(&admin, "inbox", Duration::from_secs(60)).await;
    let (pg, text) = private_postgres(&nats).await;
    let host_url = server.url().replace("nats://", "nats://host:host@");
    let text = text.replace(
        &format!("url = \"{NATS_URL}\""),
        &format!("url = \"{host_url}\"\ninbox_prefix = \"idemhost_inbox\""),
    );
    assert!(text.contains("idemhost_inbox"), "{text}");
    publish_orders(&nats, N).await;
    let host = RunningHost::start(idemhost::Host::new(parse_config(&text)));
    nats.wait_drained(NAME, Duration::from_secs(120)).await;
    host.stop().await;
    let markers = scalar(&pg, MARKERS).await;
    let reserved = scalar(&pg, "SELECT reserved FROM inventory").await;
    assert_applied_once(markers, reserved, N, &nats).await;
}

/// A host stopped (SIGSTOP, as a frozen VM) inside a delivery's transaction: its plugin role's
/// session sits idle in that transaction, holding the claim's row lock, so the replica the
/// broker hands the message to next would wait on it for as long as the stall lasts. The server
/// ends the session after `handler_timeout` + 5 s idle (given at login); another host then
/// applies the message, once. Without the setting the session was still open after 20 s. The
/// host is stopped while its handler's `pg_sleep(1.5)` runs, so its transaction is open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_hosts_open_transaction_is_ended_by_the_server() {
    const STALLED: &str = "stalled-v1";
    let env = TestEnv::new("stalled_tx").await;
    env.execute("CREATE TABLE stalled (id text PRIMARY KEY)")
        .await;
    let nats = NatsEnv::new("stalled_tx", Duration::from_secs(60)).await;
    let text = config_text(
        &env,
        &nats,
        STALLED,
        "testkit",
        "handler_timeout = \"3s\"\nack_wait = \"2s\"\nmax_deliver = 50\nbackoff = [\"100ms\"]",
    );
    let dir = std::env::temp_dir().join(unique("idemhost_stalled"));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("idemhost.toml");
    std::fs::write(&config, &text).unwrap();
    let mut first = spawn_host(&config, None, &dir.join("first.log"));
    // A stopped host left behind by a failed assertion would never exit on its own.
    struct Killed(u32);
    impl Drop for Killed {
        fn drop(&mut self) {
            // SAFETY: a signal to our own child process.
            unsafe { libc::kill(self.0 as i32, libc::SIGKILL) };
        }
    }
    let _first_ends = Killed(first.id());
    nats.publish(
        Some("m-1"),
        r#"{"steps":[{"execute":"INSERT INTO stalled (id) VALUES ('m-1')"},{"query":"SELECT pg_catalog.pg_sleep(1.5)"}]}"#,
    )
    .await;
    // The plugin role's sessions: the test's application_name, not the test's own user.
    let sessions = |state: &'static str, query: &'static str| {
        let sql = format!(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = '{}' \
             AND usename <> current_user AND state = '{state}' AND query LIKE '{query}'",
            env.schema
        );
        let env = &env;
        async move { env.scalar(&sql).await }
    };
    wait_until(
        Duration::from_secs(60),
        "the handler in its pg_sleep",
        || async { (sessions("active", "%pg_sleep%").await > 0).then_some(()) },
    )
    .await;
    // SAFETY: signals to our own child process.
    unsafe { libc::kill(first.id() as i32, libc::SIGSTOP) };
    let stopped = Instant::now();
    wait_until(
        Duration::from_secs(60),
        "the session idle in its transaction",
        || async { (sessions("idle in transaction", "%").await > 0).then_some(()) },
    )
    .await;
    wait_until(
        Duration::from_secs(20),
        "the server to end the stalled session",
        || async { (sessions("idle in transaction", "%").await == 0).then_some(()) },
    )
    .await;
    let ended = stopped.elapsed();
    assert!(ended >= Duration::from_secs(5), "ended after {ended:?}");
    let mut second = spawn_host(&config, None, &dir.join("second.log"));
    nats.wait_drained(STALLED, Duration::from_secs(60)).await;
    assert_eq!(env.scalar("SELECT count(*) FROM stalled").await, 1);
    assert_eq!(env.markers(STALLED).await, 1);
    unsafe { libc::kill(first.id() as i32, libc::SIGKILL) };
    let _ = first.wait();
    unsafe { libc::kill(second.id() as i32, libc::SIGTERM) };
    assert!(second.wait().unwrap().success(), "a graceful stop exits 0");
    println!("stalled: the server ended the stopped host's transaction {ended:?} after the stop");
    nats.cleanup().await;
    env.cleanup().await;
    let _ = std::fs::remove_dir_all(&dir);
}
