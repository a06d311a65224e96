//! The order-flow example's fake payment provider as its own process: an idemhost embedding with
//! one native handler (`examples/order-flow/provider.toml`).
//!
//! `cargo run --example order_flow_provider -- --config examples/order-flow/provider.toml`

use std::sync::Arc;

use idemhost_bench::order_flow as provider;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let config = match (args.next().as_deref(), args.next()) {
        (Some("--config"), Some(path)) => path,
        _ => anyhow::bail!("usage: order_flow_provider --config FILE"),
    };
    let config = idemhost::Config::load(config.as_ref())?;
    idemhost::telemetry::init_tracing(config.host.log_format);
    let result = idemhost::Host::new(config)
        .with_handler(provider::CONSUMER, Arc::new(provider::FakeProvider))
        .run(
            idemhost::RunOptions::default(),
            idemhost::telemetry::shutdown_signal(),
        )
        .await;
    idemhost::telemetry::shutdown_tracing();
    Ok(result?)
}
