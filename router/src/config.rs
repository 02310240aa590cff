//! The router's command line: the serving flags it shares with the launcher (quiver-flags), plus
//! what only the router takes. Every flag also reads an environment variable.

use std::path::PathBuf;

use clap::Parser;
use quiver_flags::ServingFlags;

#[derive(Debug, Clone, Parser)]
#[command(
    name = "quiver-router",
    version,
    about = "quiver's OpenAI-compatible HTTP router"
)]
pub struct RouterArgs {
    /// Unix socket of each shard, rank 0 first (repeat the flag, or comma-separate).
    #[arg(
        long = "shard-uds",
        env = "QUIVER_SHARD_UDS",
        value_delimiter = ',',
        required = true
    )]
    pub shard_uds: Vec<PathBuf>,

    /// Hub id or directory of the base model, as given to the launcher; also accepted in `model`.
    #[arg(long, env = "MODEL_ID", default_value = "")]
    pub model_id: String,

    // HTTP, limits, adapters and shutdown, as the launcher takes them.
    #[command(flatten)]
    pub serving: ServingFlags,

    /// Log as JSON lines (for the launcher and log collectors).
    #[arg(long, env = "QUIVER_JSON_LOGS")]
    pub json_logs: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_sockets_are_required_and_keep_rank_order() {
        assert!(RouterArgs::try_parse_from(["quiver-router"]).is_err());
        let argv = [
            "quiver-router",
            "--shard-uds",
            "/s0,/s1",
            "--shard-uds",
            "/s2",
        ];
        let args = RouterArgs::try_parse_from(argv).unwrap();
        let expected: Vec<PathBuf> = ["/s0", "/s1", "/s2"].iter().map(PathBuf::from).collect();
        assert_eq!(args.shard_uds, expected);
    }

    #[test]
    fn serving_flags_parse_beside_the_routers_own() {
        let argv = [
            "quiver-router",
            "--port",
            "9000",
            "--shard-uds",
            "/s",
            "--json-logs",
        ];
        let args = RouterArgs::try_parse_from(argv).unwrap();
        assert_eq!((args.serving.port, args.json_logs), (9000, true));
        assert_eq!(args.serving.max_concurrent_requests, 512);
    }
}
