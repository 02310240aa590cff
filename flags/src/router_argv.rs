//! From parsed serving flags back to a command line, for the launcher to start the router with.

use std::ffi::OsString;

use crate::{ReasoningParserFlag, ServingFlags, ToolCallParser};

impl ServingFlags {
    /// Arguments that make `quiver-router` parse these same flags: each flag that has a value,
    /// defaults included, so the router runs with exactly what the launcher parsed. The API key
    /// is not among them: it goes through the environment ([`crate::API_KEY_ENV`]).
    pub fn to_router_args(&self) -> Vec<OsString> {
        // No `..`: a flag added to the struct does not compile until it is handled here.
        let ServingFlags {
            port,
            hostname,
            max_input_tokens,
            max_total_tokens,
            max_batch_prefill_tokens,
            prefix_caching,
            chunked_prefill,
            prefill_pace,
            mixed_prefill,
            max_batch_total_tokens,
            max_batch_size,
            max_concurrent_requests,
            max_choices_per_request,
            max_request_kv_share,
            max_logprob_entries,
            max_stop_sequences,
            preemption_wait_ms,
            max_queue_wait_secs,
            adapter_source,
            adapter_root,
            s3_adapter_buckets,
            preload_adapters,
            max_active_adapters,
            max_lora_rank,
            lora_rank_classes,
            served_model_name,
            api_key: _,
            api_keys_file,
            graceful_shutdown_secs,
            header_read_timeout_secs,
            body_read_timeout_secs,
            body_read_min_rate,
            keep_alive_timeout_secs,
            max_connections,
            max_request_body_bytes,
            tool_call_parser,
            reasoning_parser,
            metrics_open,
            metrics_max_adapter_labels,
            otlp_endpoint,
            otel_service_name,
        } = self;
        let mut argv = Argv::default();
        argv.flag("--port", port.to_string())
            .flag("--hostname", hostname)
            .flag_if_set(
                "--max-input-tokens",
                max_input_tokens.map(|n| n.to_string()),
            )
            .flag_if_set(
                "--max-total-tokens",
                max_total_tokens.map(|n| n.to_string()),
            )
            .flag_if_set(
                "--max-batch-prefill-tokens",
                max_batch_prefill_tokens.map(|n| n.to_string()),
            )
            .flag("--prefix-caching", prefix_caching.to_string())
            .flag("--chunked-prefill", chunked_prefill.to_string())
            .flag("--prefill-pace", prefill_pace.to_string())
            .flag("--mixed-prefill", mixed_prefill.to_string())
            .flag_if_set(
                "--max-batch-total-tokens",
                max_batch_total_tokens.map(|n| n.to_string()),
            )
            .flag("--max-batch-size", max_batch_size.to_string())
            .flag(
                "--max-concurrent-requests",
                max_concurrent_requests.to_string(),
            )
            .flag(
                "--max-choices-per-request",
                max_choices_per_request.to_string(),
            )
            .flag("--max-request-kv-share", max_request_kv_share.to_string())
            .flag_if_set(
                "--max-logprob-entries",
                max_logprob_entries.map(|n| n.to_string()),
            )
            .flag("--max-stop-sequences", max_stop_sequences.to_string())
            .flag("--preemption-wait-ms", preemption_wait_ms.to_string())
            .flag("--max-queue-wait-secs", max_queue_wait_secs.to_string())
            .flag("--adapter-source", adapter_source.as_str())
            .flag_if_set("--adapter-root", adapter_root.as_deref())
            .flag_if_set(
                "--s3-adapter-buckets",
                (!s3_adapter_buckets.is_empty()).then(|| s3_adapter_buckets.join(",")),
            )
            // The flag splits on commas, so ids never contain one and the join is lossless.
            .flag_if_set(
                "--preload-adapters",
                (!preload_adapters.is_empty()).then(|| preload_adapters.join(",")),
            )
            .flag("--max-active-adapters", max_active_adapters.to_string())
            .flag("--max-lora-rank", max_lora_rank.to_string())
            .flag_if_set(
                "--lora-rank-classes",
                lora_rank_classes.as_ref().map(ToString::to_string),
            )
            .flag_if_set("--served-model-name", served_model_name.as_deref())
            // A path, not a secret: the keys in it are digests.
            .flag_if_set("--api-keys-file", api_keys_file.as_deref())
            .flag(
                "--graceful-shutdown-secs",
                graceful_shutdown_secs.to_string(),
            )
            .flag(
                "--header-read-timeout-secs",
                header_read_timeout_secs.to_string(),
            )
            .flag(
                "--body-read-timeout-secs",
                body_read_timeout_secs.to_string(),
            )
            .flag("--body-read-min-rate", body_read_min_rate.to_string())
            .flag(
                "--keep-alive-timeout-secs",
                keep_alive_timeout_secs.to_string(),
            )
            .flag("--max-connections", max_connections.to_string())
            .flag(
                "--max-request-body-bytes",
                max_request_body_bytes.to_string(),
            )
            .flag_if_set(
                "--tool-call-parser",
                tool_call_parser.map(ToolCallParser::name),
            )
            .flag_if_set(
                "--reasoning-parser",
                reasoning_parser.map(ReasoningParserFlag::name),
            )
            .flag("--metrics-open", metrics_open.to_string())
            .flag(
                "--metrics-max-adapter-labels",
                metrics_max_adapter_labels.to_string(),
            )
            .flag_if_set("--otlp-endpoint", otlp_endpoint.as_deref())
            .flag("--otel-service-name", otel_service_name);
        argv.0
    }
}

/// A command line being built. Values stay `OsString`, so a path that is not UTF-8 survives.
#[derive(Default)]
struct Argv(Vec<OsString>);

impl Argv {
    fn flag(&mut self, name: &str, value: impl Into<OsString>) -> &mut Self {
        self.0.push(name.into());
        self.0.push(value.into());
        self
    }

    /// Left out when unset, so the router applies the same default the launcher saw.
    fn flag_if_set(&mut self, name: &str, value: Option<impl Into<OsString>>) -> &mut Self {
        if let Some(value) = value {
            self.flag(name, value);
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use clap::{CommandFactory, Parser};

    use super::*;
    use crate::test_cli::{try_parse, Cli};
    use crate::AdapterSource;

    fn parse(args: Vec<OsString>) -> ServingFlags {
        try_parse(args).unwrap()
    }

    /// Every flag away from its default (the API key aside: it never rides on the command line).
    fn all_set() -> ServingFlags {
        ServingFlags {
            port: 9000,
            hostname: "0.0.0.0".into(),
            max_input_tokens: Some(1000),
            max_total_tokens: Some(2048),
            max_batch_prefill_tokens: Some(4096),
            prefix_caching: false,
            chunked_prefill: false,
            prefill_pace: 0.5,
            mixed_prefill: false,
            max_batch_total_tokens: Some(100_000),
            max_batch_size: 32,
            max_concurrent_requests: 64,
            max_choices_per_request: 100,
            max_request_kv_share: 0.25,
            max_logprob_entries: Some(5000),
            max_stop_sequences: 3,
            preemption_wait_ms: 20,
            max_queue_wait_secs: 9,
            adapter_source: AdapterSource::Local,
            adapter_root: Some(PathBuf::from("/adapters")),
            s3_adapter_buckets: vec!["team-a".into(), "shared.adapters".into()],
            preload_adapters: vec!["a".into(), "org/b@v1".into()],
            max_active_adapters: 4,
            max_lora_rank: 32,
            lora_rank_classes: Some(crate::RankClasses(vec![
                crate::RankClass { rank: 16, count: 1 },
                crate::RankClass { rank: 4, count: 2 },
            ])),
            served_model_name: Some("my-model".into()),
            api_key: None,
            api_keys_file: Some(PathBuf::from("/etc/quiver/keys.yaml")),
            graceful_shutdown_secs: 7,
            header_read_timeout_secs: 3,
            body_read_timeout_secs: 4,
            body_read_min_rate: 100,
            keep_alive_timeout_secs: 9,
            max_connections: 11,
            max_request_body_bytes: 12345,
            tool_call_parser: Some(ToolCallParser::Mistral),
            reasoning_parser: Some(ReasoningParserFlag::None),
            metrics_open: true,
            metrics_max_adapter_labels: 5,
            otlp_endpoint: Some("http://127.0.0.1:4317".into()),
            otel_service_name: "llm-serving".into(),
        }
    }

    #[test]
    fn every_flag_reaches_the_router_unchanged() {
        let flags = all_set();
        assert_eq!(parse(flags.to_router_args()), flags);
    }

    #[test]
    fn defaults_reach_the_router_unchanged() {
        let defaults = parse(Vec::new());
        assert_eq!(parse(defaults.to_router_args()), defaults);
    }

    #[test]
    fn every_flag_but_the_api_key_is_on_the_command_line() {
        let args: Vec<_> = all_set().to_router_args();
        for arg in Cli::command().get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            let flag = format!("--{long}");
            let forwarded = args.iter().any(|a| *a == *flag);
            assert_eq!(
                forwarded,
                !["--help", "--api-key"].contains(&flag.as_str()),
                "{flag}"
            );
        }
    }

    #[test]
    fn the_api_key_stays_off_the_command_line() {
        let flags = ServingFlags {
            api_key: Some("sk-secret".into()),
            api_keys_file: None,
            ..all_set()
        };
        let args = flags.to_router_args();
        assert!(!args
            .iter()
            .any(|a| a.to_string_lossy().contains("sk-secret")));
    }

    #[test]
    fn one_key_and_a_keys_file_conflict() {
        let argv = [
            "quiver-router",
            "--api-key",
            "k",
            "--api-keys-file",
            "/k.yaml",
        ];
        let error = Cli::try_parse_from(argv).err().unwrap();
        assert_eq!(error.kind(), clap::error::ErrorKind::ArgumentConflict);
    }

    #[test]
    fn every_flag_reads_a_quiver_variable() {
        for arg in Cli::command().get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            if long == "help" {
                continue;
            }
            let env = arg
                .get_env()
                .unwrap_or_else(|| panic!("--{long} has no variable"));
            let expected = format!("QUIVER_{}", long.to_uppercase().replace('-', "_"));
            assert_eq!(env.to_string_lossy(), expected);
        }
    }
}
