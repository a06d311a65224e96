//! The throughput targets (issue "throughput, round two") as ratios of this run's own
//! measurements, each with its goal and whether it was met: the bench reports them, it never
//! asserts them (a timed assertion fails on a busy machine, not on slow code).

use super::HostRun;

/// One target: what is compared, the measured value, the goal and which way it points.
struct Target {
    name: String,
    measured: Option<f64>,
    goal: f64,
    /// `true`: at least the goal; `false`: at most (below, for latency).
    at_least: bool,
    unit: &'static str,
}

impl Target {
    fn met(&self) -> Option<bool> {
        self.measured.map(|m| {
            if self.at_least {
                m >= self.goal
            } else {
                m <= self.goal
            }
        })
    }
}

/// The measured inputs of the targets.
pub(super) struct Inputs<'a> {
    pub runs: &'a [HostRun],
    /// Client count the per-message targets are read at (16, or the run's largest).
    pub at: u32,
    pub pgbench_at: Option<f64>,
    /// PostgreSQL's CPU per transaction of pgbench at [`Inputs::at`] clients (µs).
    pub pgbench_cpu_at: Option<f64>,
    pub pgbench_best: Option<f64>,
    pub node_at: Option<f64>,
    /// End-to-end p99 of the paced run at half the default configuration's peak.
    pub p99_ms: Option<f64>,
    /// The run of the default configuration: `batch` (group commit with its defaults) or
    /// `wasm` (when the group-commit runs were skipped or ran with other settings).
    pub default_mode: &'a str,
}

/// Prints the targets table; the targets as JSON.
pub(super) fn report(i: &Inputs) -> serde_json::Value {
    let rate = |mode: &str| {
        i.runs
            .iter()
            .find(|r| r.mode == mode && r.concurrency == i.at)
    };
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    };
    let wasm = rate("wasm").map(|r| r.per_second);
    let native = rate("native").map(|r| r.per_second);
    let batch = rate("batch").map(|r| r.per_second);
    let c = i.at;
    let default = rate(i.default_mode).map(|r| r.per_second);
    let default_label = match i.default_mode {
        "batch" => "group commit, WASM",
        _ => "per message, WASM: the group-commit run was not at its defaults",
    };
    let mut targets = vec![
        Target {
            name: "per message: WASM / the seed's Node consumer".into(),
            measured: ratio(wasm, i.node_at),
            goal: 2.0,
            at_least: true,
            unit: "×",
        },
        Target {
            name: "per message: WASM / pgbench (the seed transaction, no broker)".into(),
            measured: ratio(wasm, i.pgbench_at),
            goal: 0.85,
            at_least: true,
            unit: "×",
        },
        Target {
            name: "per message: WASM / native handler".into(),
            measured: ratio(wasm, native),
            goal: 0.95,
            at_least: true,
            unit: "×",
        },
        Target {
            name: "PostgreSQL CPU per delivery, per message (WASM) / per pgbench transaction"
                .into(),
            measured: ratio(
                rate("wasm").and_then(|r| r.pg_cpu_us_per_msg),
                i.pgbench_cpu_at,
            ),
            goal: 1.3,
            at_least: false,
            unit: "×",
        },
        Target {
            name: "PostgreSQL CPU per delivery, group commit (WASM) / per pgbench transaction"
                .into(),
            measured: ratio(
                rate("batch").and_then(|r| r.pg_cpu_us_per_msg),
                i.pgbench_cpu_at,
            ),
            goal: 0.5,
            at_least: false,
            unit: "×",
        },
        Target {
            name: "host CPU per WASM delivery (per message)".into(),
            measured: rate("wasm").map(|r| r.cpu_us_per_msg),
            goal: 70.0,
            at_least: false,
            unit: " µs",
        },
        Target {
            name: "host CPU per WASM delivery (group commit)".into(),
            measured: rate("batch").map(|r| r.cpu_us_per_msg),
            goal: 40.0,
            at_least: false,
            unit: " µs",
        },
        Target {
            name: format!("default config ({default_label}) / pgbench's best tps"),
            measured: ratio(default, i.pgbench_best),
            goal: 2.0,
            at_least: true,
            unit: "×",
        },
    ];
    if i.default_mode != "batch" {
        targets.push(Target {
            name: "group commit (--batch-*) / pgbench's best tps".into(),
            measured: ratio(batch, i.pgbench_best),
            goal: 2.0,
            at_least: true,
            unit: "×",
        });
    }
    targets.push(Target {
        name: format!("p99 end to end, default config ({default_label}) at half its peak"),
        measured: i.p99_ms,
        goal: 10.0,
        at_least: false,
        unit: " ms",
    });
    println!();
    println!("| target at c={c} | measured | goal | met |");
    println!("|---|---|---|---|");
    let mut json = Vec::new();
    for t in &targets {
        let shown = |v: f64| {
            if t.unit == "×" {
                format!("{v:.2}{}", t.unit)
            } else {
                format!("{v:.1}{}", t.unit)
            }
        };
        let met = match t.met() {
            Some(true) => "yes",
            Some(false) => "no",
            None => "not measured",
        };
        println!(
            "| {} | {} | {} {} | {met} |",
            t.name,
            t.measured.map_or("–".to_string(), shown),
            if t.at_least { "≥" } else { "≤" },
            shown(t.goal),
        );
        json.push(serde_json::json!({
            "target": t.name, "measured": t.measured, "goal": t.goal,
            "at_least": t.at_least, "met": t.met(),
        }));
    }
    serde_json::Value::Array(json)
}
