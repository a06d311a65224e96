//! What `/metrics` shows of the plugins, read at scrape time: each consumer's current version
//! (`idemhost_plugin_info`) and its instantiation times.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabelSet, EncodeMetric as _, NoLabelSet,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::gauge::Gauge;

use super::Plugins;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PluginLabels {
    consumer: String,
    digest: String,
}

/// Reads the plugin registry at scrape time: `idemhost_plugin_info{consumer, digest}` and
/// `idemhost_plugin_instantiate_seconds{consumer, digest}` of each consumer's current version.
pub(crate) struct PluginCollector(pub(crate) Arc<Plugins>);

impl std::fmt::Debug for PluginCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PluginCollector")
    }
}

impl Collector for PluginCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let current: Vec<_> = self
            .0
            .consumers()
            .map(|slot| (slot.consumer().to_string(), slot.current_active()))
            .collect();
        let mut info = encoder.encode_descriptor(
            "plugin_info",
            "The plugin version each consumer runs (value 1)",
            None,
            MetricType::Gauge,
        )?;
        for (consumer, active) in &current {
            let labels = PluginLabels {
                consumer: consumer.clone(),
                digest: active.version.digest.clone(),
            };
            let one = Gauge::<i64>::default();
            one.set(1);
            one.encode(info.encode_family(&labels)?)?;
        }
        let mut inst = encoder.encode_descriptor(
            "plugin_instantiate_seconds",
            "Creating a plugin instance for one delivery (current version)",
            None,
            MetricType::Histogram,
        )?;
        for (consumer, active) in &current {
            let Some(timings) = active.handler.timings() else {
                continue;
            };
            let labels = PluginLabels {
                consumer: consumer.clone(),
                digest: active.version.digest.clone(),
            };
            let (sum, count, buckets) = timings.instantiate.octaves(Duration::from_micros(64));
            inst.encode_family(&labels)?
                .encode_histogram::<NoLabelSet>(sum, count, &buckets, None)?;
        }
        Ok(())
    }
}
