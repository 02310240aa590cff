//! `ShardClient` over real unix sockets, against tonic servers that serve `FakeShard`s: the
//! fan-out reaches every rank, rank 0 answers, errors keep their gRPC code and message, and
//! the scheduler runs end to end over gRPC.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use quiver_flags::AdapterSource;
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;

use super::served_fake::Served;
use super::*;
use crate::pb::shard_server::ShardServer;

/// A fresh socket directory per test (no tempfile crate in the workspace).
struct SocketDir(PathBuf);

impl SocketDir {
    fn new() -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("quiver-shard-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn socket(&self, rank: usize) -> PathBuf {
        self.0.join(format!("rank-{rank}.sock"))
    }
}

impl Drop for SocketDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn serve(shard: Arc<FakeShard>, path: &Path) {
    let listener = UnixListener::bind(path).unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(ShardServer::new(Served(shard)))
            .serve_with_incoming(UnixListenerStream::new(listener)),
    );
}

/// `world_size` fake ranks behind sockets, and a client connected to all of them.
async fn ranks(dir: &SocketDir, world_size: u32) -> (Vec<Arc<FakeShard>>, ShardClient) {
    ranks_with(dir, world_size, |shard| shard).await
}

/// As `ranks`, with `build` applied to each rank's fake.
async fn ranks_with(
    dir: &SocketDir,
    world_size: u32,
    build: impl Fn(FakeShard) -> FakeShard,
) -> (Vec<Arc<FakeShard>>, ShardClient) {
    let mut shards = Vec::new();
    let mut paths = Vec::new();
    for rank in 0..world_size {
        let shard = Arc::new(build(
            FakeShard::new(256).with_eos(1).with_rank(rank, world_size),
        ));
        let path = dir.socket(rank as usize);
        serve(shard.clone(), &path);
        shards.push(shard);
        paths.push(path);
    }
    let client = ShardClient::connect(&paths).await.unwrap();
    (shards, client)
}

fn one_request(id: u64, prompt: Vec<u32>, blocks: Vec<u32>, max_new_tokens: u32) -> PrefillEntry {
    PrefillEntry {
        id,
        input_ids: prompt,
        blocks,
        sampling: SamplingParams {
            seed: 7,
            ..SamplingParams::default()
        },
        draws_done: 0,
        max_new_tokens,
        adapter_id: String::new(),
        prompt_logprobs: None,
        grammar_id: None,
        cached_tokens: 0,
        prefill_until: 0,
        embed: false,
    }
}

#[tokio::test]
async fn every_rank_sees_each_call_and_rank_zero_answers() {
    let dir = SocketDir::new();
    let (shards, client) = ranks(&dir, 2).await;
    assert_eq!(client.rank_infos().await.unwrap().len(), 2);
    client.health().await.unwrap();
    let info = client.info().await.unwrap();
    assert_eq!((info.rank, info.world_size, info.vocab_size), (0, 2, 256));
    assert_eq!(info.eos_token_ids, vec![1]);

    let prefill = client
        .prefill(
            3,
            vec![
                one_request(10, vec![5], vec![0], 4),
                one_request(11, vec![6, 2], vec![1], 4),
            ],
        )
        .await
        .unwrap();
    // (31 t + 7) mod 256 of each prompt's last token.
    let tokens: Vec<u32> = prefill.generations.iter().map(|g| g.token_id).collect();
    assert_eq!(tokens, vec![162, 69]);
    let batch = prefill.batch.unwrap();
    assert!(shards.iter().all(|s| s.live_requests() == 2));

    let decode = client.decode(vec![batch]).await.unwrap();
    let tokens: Vec<u32> = decode.generations.iter().map(|g| g.token_id).collect();
    assert_eq!(tokens, vec![(162 * 31 + 7) % 256, (69 * 31 + 7) % 256]);

    let filtered = client.filter_batch(3, vec![11]).await.unwrap();
    assert_eq!(filtered.unwrap().request_ids, vec![11]);
    assert!(shards.iter().all(|s| s.live_requests() == 1));

    client.clear_cache(None).await.unwrap();
    assert!(shards
        .iter()
        .all(|s| s.live_requests() == 0 && s.live_batches() == 0));
}

#[tokio::test]
async fn a_decode_carrying_a_prefill_reaches_every_rank_and_answers_both() {
    let dir = SocketDir::new();
    let (shards, client) = ranks(&dir, 2).await;
    let prefill = client
        .prefill(3, vec![one_request(10, vec![5], vec![0], 4)])
        .await
        .unwrap();
    let running = prefill.batch.unwrap();
    let mixed = client
        .decode_with_prefill(
            vec![running],
            4,
            vec![one_request(11, vec![6, 2], vec![1], 4)],
        )
        .await
        .unwrap();
    // Request 10 decodes from its first token, next(5) = 162; request 11 gets its first.
    let decoded: Vec<u32> = mixed
        .decode
        .generations
        .iter()
        .map(|g| g.token_id)
        .collect();
    assert_eq!(decoded, vec![(162 * 31 + 7) % 256]);
    let first: Vec<u32> = mixed
        .prefill
        .generations
        .iter()
        .map(|g| g.token_id)
        .collect();
    assert_eq!(first, vec![2 * 31 + 7]);
    assert_eq!(mixed.prefill.batch.unwrap().request_ids, vec![11]);
    let joined = mixed.decode.batch.unwrap();
    assert_eq!((joined.id, joined.request_ids.clone()), (3, vec![10, 11]));
    for shard in &shards {
        assert_eq!((shard.live_requests(), shard.live_batches()), (2, 1));
        assert_eq!(shard.stats().mixed_calls, 1);
    }
    // The joined batch decodes as one on every rank.
    let next = client.decode(vec![joined]).await.unwrap();
    assert_eq!(next.generations.len(), 2);
}

#[tokio::test]
async fn warmup_gives_every_rank_the_slot_ranks() {
    let dir = SocketDir::new();
    let (shards, client) = ranks(&dir, 2).await;
    let limits = WarmupLimits {
        max_active_adapters: 3,
        max_lora_rank: 64,
        slot_ranks: vec![8, 16, 64],
        ..Default::default()
    };
    client.warmup(limits.clone()).await.unwrap();
    for shard in &shards {
        assert_eq!(shard.adapter_slot_ranks(), vec![8, 16, 64]);
        assert_eq!(shard.active_adapters(), vec![None, None, None]);
    }
    // Without classes the list stays empty: the shards size every slot at max_lora_rank.
    let uniform = WarmupLimits {
        slot_ranks: Vec::new(),
        ..limits
    };
    client.warmup(uniform).await.unwrap();
    assert!(shards.iter().all(|s| s.adapter_slot_ranks().is_empty()));
}

#[tokio::test]
async fn errors_keep_their_code_message_and_rank() {
    let dir = SocketDir::new();
    let (shards, client) = ranks(&dir, 2).await;

    // 1 prompt token + 40 new tokens do not fit one 16-token block.
    let short_table = vec![one_request(1, vec![5], vec![0], 40)];
    let error = client.prefill(0, short_table).await.unwrap_err();
    assert_eq!(error.code(), tonic::Code::InvalidArgument);
    assert!(matches!(&error, ShardError::InvalidArgument(m) if m.contains("block table")));

    shards[1].fail_next(FakeRpc::Health);
    let error = client.health().await.unwrap_err();
    assert_eq!(error.code(), tonic::Code::Internal);
    assert!(
        matches!(&error, ShardError::Status { rank: 1, message, .. } if message.contains("injected")),
        "{error:?}"
    );
    // Rank 0 answered; the call still failed because rank 1 did.
    client.health().await.unwrap();
}

#[tokio::test]
async fn connecting_to_a_missing_socket_names_it() {
    let dir = SocketDir::new();
    let missing = dir.socket(0);
    let error = ShardClient::connect(std::slice::from_ref(&missing))
        .await
        .unwrap_err();
    assert!(
        matches!(&error, ShardError::Connect { path, .. } if *path == missing),
        "{error:?}"
    );
    assert!(error.to_string().contains("rank-0.sock"));
    assert!(ShardClient::connect(&[]).await.is_err());
}

#[tokio::test]
async fn the_scheduler_runs_over_grpc() {
    use crate::scheduler::{FinishReason, GenerationRequest, SamplingParams, Scheduler};

    let dir = SocketDir::new();
    let (shards, client) = ranks(&dir, 2).await;
    let warmup = client
        .warmup(WarmupLimits {
            max_batch_prefill_tokens: 64,
            max_total_tokens: 64,
            max_batch_size: 8,
            max_batch_total_tokens: 0,
            ..Default::default()
        })
        .await
        .unwrap();
    let config = crate::scheduler::SchedulerConfig {
        block_size: warmup.block_size,
        num_blocks: warmup.num_blocks,
        max_batch_prefill_tokens: 64,
        max_batch_total_tokens: 0,
        max_batch_size: 8,
        max_concurrent_requests: 8,
        max_total_tokens: 64,
        max_active_adapters: 0,
        slot_ranks: Vec::new(),
        preemption_wait: std::time::Duration::from_millis(500),
        max_queue_wait: None,
        prefix_caching: true,
        chunked_prefill: true,
        prefill_pace: 0.0,
        mixed_prefill: true,
    };
    let scheduler = Scheduler::start_observed(Arc::new(client), config, Arc::default());
    let mut events = scheduler
        .submit(GenerationRequest {
            input_ids: vec![1, 2, 3],
            max_new_tokens: 5,
            sampling: SamplingParams::default(),
            eos_token_ids: vec![1],
            ignore_eos: false,
            stop_token_ids: Vec::new(),
            min_tokens: 0,
            adapter_id: String::new(),
            adapter_rank: 0,
            prompt_logprobs: None,
            grammar: None,
            embed: false,
            scope: Default::default(),
        })
        .unwrap();
    let mut tokens = Vec::new();
    let mut previous = 3u32;
    let mut expected = Vec::new();
    for _ in 0..5 {
        previous = (previous * 31 + 7) % 256;
        expected.push(previous);
    }
    let finish = loop {
        let event = events.recv().await.unwrap().unwrap();
        tokens.push(event.token_id);
        if let Some(reason) = event.finish {
            break reason;
        }
    };
    assert_eq!(tokens, expected);
    assert_eq!(finish, FinishReason::Length);
    for shard in &shards {
        while shard.live_requests() > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
    }
}

fn adapter_load(adapter_id: &str, source: &str, path: &str) -> AdapterLoad {
    AdapterLoad {
        adapter_id: adapter_id.to_string(),
        source: AdapterSource::parse(source).unwrap(),
        path: path.to_string(),
        revision: "main".to_string(),
    }
}

#[tokio::test]
async fn a_hub_adapter_is_downloaded_by_rank_zero_then_loaded_from_its_path() {
    let dir = SocketDir::new();
    // Only rank 0 knows where its download lands; every fake rank other than 0 refuses a hub
    // load without a path, so a plain fan-out would fail.
    let (shards, client) = ranks_with(&dir, 3, |shard| {
        shard
            .with_adapter_path("owner/name", "/cache/owner--name")
            .with_adapter_load_delay(std::time::Duration::from_millis(20))
    })
    .await;
    let response = client
        .load_adapter(adapter_load("owner/name", "hub", ""))
        .await
        .unwrap();
    assert_eq!(response.path, "/cache/owner--name");
    assert_eq!(
        shards[0].adapter_load_requests(),
        vec![adapter_load("owner/name", "hub", "")]
    );
    for shard in &shards[1..] {
        assert_eq!(
            shard.adapter_load_requests(),
            vec![adapter_load("owner/name", "hub", "/cache/owner--name")]
        );
    }
    assert!(shards
        .iter()
        .all(|s| s.loaded_adapters() == vec!["owner/name".to_string()]));
}

#[tokio::test]
async fn a_failed_hub_download_never_reaches_the_other_ranks() {
    let dir = SocketDir::new();
    let (shards, client) = ranks(&dir, 2).await;
    shards[0].fail_adapter_load_with("owner/missing", tonic::Code::NotFound, "no such repo");
    let error = client
        .load_adapter(adapter_load("owner/missing", "hub", ""))
        .await
        .unwrap_err();
    assert_eq!(error.code(), tonic::Code::NotFound);
    assert_eq!(error.message(), "no such repo");
    assert!(matches!(error, ShardError::Status { rank: 0, .. }));
    assert!(shards[1].adapter_load_requests().is_empty());
}

#[tokio::test]
async fn every_rank_answers_for_itself_when_asked_for_each_ranks_info() {
    let dir = SocketDir::new();
    let (_shards, client) = ranks(&dir, 3).await;
    let infos = client.rank_infos().await.unwrap();
    let ranks: Vec<(u32, u32)> = infos.iter().map(|i| (i.rank, i.world_size)).collect();
    assert_eq!(ranks, vec![(0, 3), (1, 3), (2, 3)]);
    assert_eq!(client.info().await.unwrap().rank, 0);
}

#[tokio::test]
async fn a_load_that_fails_on_one_rank_is_undone_on_the_others() {
    let dir = SocketDir::new();
    // Rank 0 loads slower than rank 2 fails: the router waits for it before undoing its load.
    let (shards, client) = ranks_with(&dir, 3, |shard| {
        shard.with_adapter_load_delay(std::time::Duration::from_millis(30))
    })
    .await;
    shards[2].fail_adapter_load_with("team/a", tonic::Code::ResourceExhausted, "no memory");
    let error = client
        .load_adapter(adapter_load("team/a", "local", "/adapters/team/a"))
        .await
        .unwrap_err();
    assert!(
        matches!(error, ShardError::Status { rank: 2, .. }),
        "{error:?}"
    );
    assert_eq!(error.code(), tonic::Code::ResourceExhausted);
    for shard in &shards[..2] {
        assert_eq!(shard.unloaded_adapters(), vec!["team/a".to_string()]);
    }
    assert!(shards.iter().all(|s| s.loaded_adapters().is_empty()));
    assert!(shards[2].unloaded_adapters().is_empty());
}

#[tokio::test]
async fn a_download_that_another_rank_cannot_load_is_undone_on_rank_zero() {
    let dir = SocketDir::new();
    let (shards, client) = ranks_with(&dir, 2, |shard| {
        shard.with_adapter_path("owner/name", "/cache/owner--name")
    })
    .await;
    shards[1].fail_adapter_load_with("owner/name", tonic::Code::InvalidArgument, "bad weights");
    let error = client
        .load_adapter(adapter_load("owner/name", "hub", ""))
        .await
        .unwrap_err();
    assert_eq!(error.code(), tonic::Code::InvalidArgument);
    assert_eq!(error.message(), "bad weights");
    assert_eq!(
        shards[0].unloaded_adapters(),
        vec!["owner/name".to_string()]
    );
    assert!(shards.iter().all(|s| s.loaded_adapters().is_empty()));
}

#[tokio::test]
async fn local_loads_activation_and_unload_reach_every_rank_at_once() {
    let dir = SocketDir::new();
    let (shards, client) = ranks_with(&dir, 2, |shard| shard.with_adapter_slots(2)).await;
    let local = adapter_load("team/a", "local", "/adapters/team/a");
    let response = client.load_adapter(local.clone()).await.unwrap();
    assert_eq!(response.path, "/adapters/team/a");
    // A hub adapter the router already has a path for is not downloaded again.
    let hub_with_path = adapter_load("owner/b", "hub", "/cache/b");
    client.load_adapter(hub_with_path.clone()).await.unwrap();
    for shard in &shards {
        assert_eq!(
            shard.adapter_load_requests(),
            vec![local.clone(), hub_with_path.clone()]
        );
    }

    client
        .activate_adapter("team/a".to_string(), 1)
        .await
        .unwrap();
    assert!(shards
        .iter()
        .all(|s| s.active_adapters() == vec![None, Some("team/a".to_string())]));
    let error = client
        .activate_adapter("team/a".to_string(), 2)
        .await
        .unwrap_err();
    assert_eq!(error.code(), tonic::Code::InvalidArgument);

    client.unload_adapter("team/a".to_string()).await.unwrap();
    for shard in &shards {
        assert_eq!(shard.active_adapters(), vec![None, None]);
        assert_eq!(shard.loaded_adapters(), vec!["owner/b".to_string()]);
    }
}

#[tokio::test]
async fn a_shard_that_goes_away_is_unavailable_one_that_refuses_is_not() {
    let dir = SocketDir::new();
    let shard = Arc::new(FakeShard::new(256).with_eos(1));
    let path = dir.socket(0);
    let listener = UnixListener::bind(&path).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(ShardServer::new(Served(shard.clone())))
            .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                let _ = stopped.await;
            }),
    );
    let client = ShardClient::connect(std::slice::from_ref(&path))
        .await
        .unwrap();

    // An error the shard sends is about the call, not the shard.
    shard.fail_next(FakeRpc::Health);
    assert!(client.health().await.is_err());
    assert!(!client.is_unavailable());

    // The shard goes away: its connections close and its socket refuses new ones.
    let _ = stop.send(());
    let _ = server.await;
    assert!(client.health().await.is_err());
    assert!(client.is_unavailable());

    // A shard answers on the socket again (its process lived on, only the connection broke):
    // the client dials it anew and lets calls through again.
    std::fs::remove_file(&path).unwrap();
    serve(shard.clone(), &path);
    within_seconds(10, client.reachable()).await;
    assert!(!client.is_unavailable());
    client.health().await.unwrap();
}

#[tokio::test]
async fn a_status_too_large_for_the_connection_costs_one_call_not_the_shard() {
    let dir = SocketDir::new();
    let (shards, client) = ranks(&dir, 1).await;
    // Four times what HTTP/2 lets a trailer carry by default (16 KiB of headers): the
    // connection breaks on it, as it did on an adapter refusal quoting 200 module names.
    let message = format!("target modules {}", "m".repeat(64 * 1024));
    shards[0].fail_next_with(FakeRpc::Health, message);
    let error = client.health().await.unwrap_err();
    assert!(
        error.message().len() <= crate::bounded_text::MAX_MESSAGE_BYTES,
        "{} bytes",
        error.message().len()
    );
    within_seconds(10, client.reachable()).await;
    client.health().await.unwrap();
    let info = client.info().await.unwrap();
    assert_eq!(info.vocab_size, shards[0].info().await.unwrap().vocab_size);
}

/// Awaits `event`, failing the test if it has not happened in `seconds` (a guard against a
/// hang, not a measure: the event ends the wait).
async fn within_seconds(seconds: u64, event: impl std::future::Future<Output = ()>) {
    tokio::time::timeout(std::time::Duration::from_secs(seconds), event)
        .await
        .expect("the client did not become reachable again");
}
