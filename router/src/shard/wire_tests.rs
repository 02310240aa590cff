//! Every field of the router's shard messages survives the trip to protobuf and back, so the
//! conversions drop nothing (the Python shard reads the protobuf side; the integration tests
//! run it).

use quiver_flags::AdapterSource;

use super::served_fake::{decode_response, grammar, prefill_entry, step_parts};
use super::wire::{mixed_step, step};
use super::*;
use crate::pb;

fn distinct_entry() -> PrefillEntry {
    PrefillEntry {
        id: 11,
        input_ids: vec![3, 4, 5],
        blocks: vec![7, 8],
        sampling: SamplingParams {
            temperature: 0.7,
            top_p: 0.9,
            top_k: 40,
            min_p: 0.05,
            repetition_penalty: 1.1,
            seed: 1234,
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            logit_bias: vec![(2, -1.5), (9, 3.0)],
            top_logprobs: 5,
        },
        draws_done: 6,
        max_new_tokens: 12,
        adapter_id: "team/a".to_string(),
        prompt_logprobs: Some(2),
        grammar_id: Some(17),
        cached_tokens: 1,
        prefill_until: 2,
        embed: true,
    }
}

#[test]
fn a_prefill_entry_keeps_every_field() {
    let entry = distinct_entry();
    assert_eq!(prefill_entry(pb::Request::from(entry.clone())), entry);
    for kind in [
        GrammarKind::JsonSchema,
        GrammarKind::Regex,
        GrammarKind::Lark,
    ] {
        let sent = Grammar {
            kind,
            text: "t".to_string(),
            eos_token_ids: vec![0],
        };
        assert_eq!(grammar(pb::Grammar::from(sent.clone())), sent);
    }
}

#[test]
fn a_step_keeps_every_field() {
    let sent = Step {
        generations: vec![Generation {
            request_id: 11,
            token_id: 42,
            logprob: -0.25,
            top_logprobs: vec![TokenLogprob {
                token_id: 3,
                logprob: -0.1,
            }],
            prompt_logprobs: vec![PromptPosition {
                logprob: -2.0,
                rank: 4,
                top: vec![TokenLogprob {
                    token_id: 1,
                    logprob: -0.5,
                }],
            }],
            embedding: vec![0.5, -0.5],
        }],
        batch: Some(CachedBatch {
            id: 3,
            request_ids: vec![11, 12],
        }),
        forward_ns: 100,
        grammar_ns: 7,
    };
    let (generations, batch, forward_ns, grammar_ns) = step_parts(sent.clone());
    assert_eq!(step(generations, batch, forward_ns, grammar_ns), sent);
    let (generations, batch, forward_ns, grammar_ns) = step_parts(Step::default());
    assert_eq!(step(generations, batch, forward_ns, grammar_ns).batch, None);
}

#[test]
fn a_mixed_step_keeps_both_answers_and_needs_the_prefill_one() {
    let generation = |request_id, token_id| Generation {
        request_id,
        token_id,
        logprob: -0.5,
        top_logprobs: Vec::new(),
        prompt_logprobs: Vec::new(),
        embedding: Vec::new(),
    };
    let sent = MixedStep {
        decode: Step {
            generations: vec![generation(1, 40)],
            batch: Some(CachedBatch {
                id: 0,
                request_ids: vec![1, 2],
            }),
            forward_ns: 900,
            grammar_ns: 30,
        },
        prefill: Step {
            generations: vec![generation(2, 41), generation(3, 42)],
            batch: Some(CachedBatch {
                id: 7,
                request_ids: vec![2],
            }),
            forward_ns: 0,
            grammar_ns: 0,
        },
    };
    let (generations, batch, forward_ns, grammar_ns) = step_parts(sent.prefill.clone());
    let prefill = pb::PrefillResponse {
        generations,
        batch,
        forward_ns,
        grammar_ns,
    };
    let response = decode_response(sent.decode.clone(), Some(prefill));
    assert_eq!(mixed_step(response.clone()).unwrap(), sent);
    // A shard that dropped the prefill would strand its requests: the call fails.
    let ignored = pb::DecodeResponse {
        prefill: None,
        ..response
    };
    let error = mixed_step(ignored).unwrap_err();
    assert_eq!(error.code(), tonic::Code::Internal);
    assert!(error.message().contains("no prefill answer"), "{error}");
}

#[test]
fn info_loads_and_compiles_keep_every_field() {
    let info = ShardInfo {
        model_id: "m".to_string(),
        model_type: "llama".to_string(),
        dtype: "bfloat16".to_string(),
        device: "cuda:0".to_string(),
        vocab_size: 5,
        max_position_embeddings: 6,
        rank: 1,
        world_size: 2,
        eos_token_ids: vec![3],
        model_path: "/m".to_string(),
        weight_bytes: 9,
        embedding_dim: 10,
        pooling: "last".to_string(),
        pooling_refusal: "no".to_string(),
        generation_refusal: "no head".to_string(),
    };
    assert_eq!(ShardInfo::from(pb::InfoResponse::from(info.clone())), info);

    let load = pb::LoadAdapterRequest::from(AdapterLoad {
        adapter_id: "owner/x".to_string(),
        source: AdapterSource::Hub,
        path: String::new(),
        revision: "v1".to_string(),
    });
    assert_eq!(
        (load.source.as_str(), load.revision.as_str()),
        ("hub", "v1")
    );
    let local = pb::LoadAdapterRequest::from(AdapterLoad {
        source: AdapterSource::Local,
        path: "/a".to_string(),
        ..AdapterLoad::default()
    });
    assert_eq!(
        (local.source.as_str(), local.path.as_str()),
        ("local", "/a")
    );

    let refused = GrammarCompiled::from(pb::CompileGrammarResponse {
        error: "too deep".to_string(),
        compile_ns: 5,
    });
    assert_eq!(refused.error.as_deref(), Some("too deep"));
    let compiled = GrammarCompiled::from(pb::CompileGrammarResponse {
        error: String::new(),
        compile_ns: 5,
    });
    assert_eq!(compiled.error, None);
}
