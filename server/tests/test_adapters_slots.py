"""Memory tiers: six adapters rotating through two device slots while other requests keep
decoding, a host cache smaller than the adapter set (evicted adapters are read from disk
again), slot and unload guards, and the host LRU's order and pinning."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tiny_adapters import ADAPTER_KINDS, assert_greedy_matches, build_adapter, peft_reference, reference_greedy
from tiny_models import build_tiny_model

from quiver_server.adapters.host_cache import HostAdapterCache
from quiver_server.adapters.loader import LoadedAdapter
from quiver_server.engine.batch_types import RequestSpec
from quiver_server.engine.engine import Engine
from quiver_server.kernels.lora_meta import LoraBatchMeta
from quiver_server.kernels.lora_projection import LoraProjection
from quiver_server.engine.kv_cache import BLOCK_SIZE

NEW_TOKENS = 12
PROMPT = [17, 4, 250, 31, 99, 8, 145, 60, 7, 203, 11]
KINDS = ("rank4", "rank8-attention", "rank16", "qv-only", "mlp-only", "rslora")
HOST_CAPACITY = 3


@dataclass
class Setup:
    base_dir: Path
    adapters: dict[str, Path]
    expected: dict[str, object]  # kind -> peft's greedy Reference


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    base_dir = build_tiny_model(tmp_path_factory.mktemp("base"), "llama", seed=4)
    root = tmp_path_factory.mktemp("adapters")
    adapters = {
        kind: build_adapter(base_dir, root / kind, seed=40 + i, **ADAPTER_KINDS[kind]) for i, kind in enumerate(KINDS)
    }
    expected = {
        kind: reference_greedy(peft_reference(base_dir, path), PROMPT, NEW_TOKENS) for kind, path in adapters.items()
    }
    return Setup(base_dir, adapters, expected)


def _engine(setup: Setup, slots: int = 2, max_cpu_adapters: int = HOST_CAPACITY, dtype: str = "float32") -> Engine:
    engine = Engine(str(setup.base_dir), "tiny", dtype=dtype, device="cpu", cpu_kv_cache_gib=0.01,
                    max_cpu_adapters=max_cpu_adapters)
    engine.warmup(128, 64, 8, max_active_adapters=slots, max_lora_rank=16)
    return engine


def _request(rid: int, kind: str) -> RequestSpec:
    per_request = -(-(len(PROMPT) + NEW_TOKENS) // BLOCK_SIZE)
    blocks = list(range(rid * per_request, (rid + 1) * per_request))
    return RequestSpec(id=rid, input_ids=PROMPT, blocks=blocks, max_new_tokens=NEW_TOKENS, adapter_id=kind)


def test_six_adapters_rotate_through_two_slots_while_others_decode(setup: Setup) -> None:
    """The router's pattern: an adapter is activated into a slot once the requests using it have
    finished; meanwhile the request in the other slot keeps decoding. With a host cache of three,
    every second round re-reads adapters from disk."""
    engine = _engine(setup)
    for kind, path in setup.adapters.items():
        engine.lora.load(kind, "local", str(path))
    # LRU: the last three loads are in host memory, the first three were evicted.
    assert engine.lora.registry.host.ids() == list(KINDS[-HOST_CAPACITY:])

    outputs: dict[int, list[int]] = {}
    running: dict[int, str] = {}  # request id -> adapter
    batch_ids: list[int] = []

    def step() -> None:
        result = engine.decode(batch_ids)
        batch_ids[:] = [result.batch_id]
        for g in result.generations:
            outputs[g.request_id].append(g.token_id)
        done = [rid for rid in running if len(outputs[rid]) == NEW_TOKENS]
        for rid in done:
            del running[rid]
        if done:
            kept = engine.filter_batch(result.batch_id, list(running))
            if not kept:
                batch_ids.clear()

    plan = [*KINDS, *reversed(KINDS)]
    for rid, kind in enumerate(plan):
        slot = rid % 2
        if rid == 1:
            with pytest.raises(ValueError, match="running requests use"):
                engine.activate_adapter(kind, 0)  # slot 0 serves request 0
            with pytest.raises(ValueError, match="still has running requests"):
                engine.unload_adapter(plan[0])
        while any(engine.lora.slots.slot_of(running_kind) == slot for running_kind in running.values()):
            step()
        engine.activate_adapter(kind, slot)
        result = engine.prefill(1000 + rid, [_request(rid, kind)])
        outputs[rid] = [result.generations[0].token_id]
        running[rid] = kind
        batch_ids.append(result.batch_id)
        step()  # the new request and the one in the other slot decode together
        # The slots' two adapters do not count against the host cache's capacity.
        assert len(engine.lora.registry.host) <= HOST_CAPACITY + 2
    while running:
        step()
    for rid, kind in enumerate(plan):
        assert_greedy_matches(outputs[rid], setup.expected[kind], f"request {rid} ({kind})")


def test_unload_frees_slot_and_host_copy(setup: Setup) -> None:
    engine = _engine(setup)
    engine.lora.load("a", "local", str(setup.adapters["rank4"]))
    engine.activate_adapter("a", 1)
    assert engine.lora.slots.slot_of("a") == 1
    engine.unload_adapter("a")
    assert engine.lora.slots.adapter_in(1) is None
    assert "a" not in engine.lora.registry and len(engine.lora.registry.host) == 0
    slots = engine.lora.slots
    assert all(float(slots.buffers(where, 1)[0].abs().max()) == 0 for where in slots.projections)
    assert all(int(slots.buffers(where, 1)[2][0]) == 0 for where in slots.projections)
    with pytest.raises(ValueError, match="'a' is not active in a slot"):
        engine.prefill(1, [_request(0, "a")])
    with pytest.raises(ValueError, match="'a' is not loaded"):
        engine.activate_adapter("a", 0)
    engine.unload_adapter("never-loaded")  # idempotent
    # Loaded again (from anywhere) it serves as before.
    engine.lora.load("a", "local", str(setup.adapters["qv-only"]))
    engine.activate_adapter("a", 0)
    outputs = [engine.prefill(1, [_request(0, "a")]).generations[0].token_id]
    outputs += [engine.decode([1]).generations[0].token_id for _ in range(NEW_TOKENS - 1)]
    assert_greedy_matches(outputs, setup.expected["qv-only"], "reloaded")


def test_slot_ranks_follow_each_occupant(setup: Setup) -> None:
    """Each projection records the rank of the adapter in each slot, 0 where it targets nothing:
    the CPU kernel reads that many rank rows and skips the projection at 0."""
    engine = _engine(setup)
    for kind in ("rank16", "qv-only", "rank8-attention"):
        engine.lora.load(kind, "local", str(setup.adapters[kind]))
    slots = engine.lora.slots

    def ranks(slot: int) -> dict[str, set[int]]:
        by_name: dict[str, set[int]] = {}
        for where in slots.projections:
            by_name.setdefault(where[1], set()).add(int(slots.buffers(where, slot)[2][0]))
        return by_name

    engine.activate_adapter("rank16", 0)
    engine.activate_adapter("rank8-attention", 1)
    assert set().union(*ranks(0).values()) == {16}
    assert ranks(1) == {"q_proj": {8}, "k_proj": {8}, "v_proj": {8}, "o_proj": {8},
                        "gate_proj": {0}, "up_proj": {0}, "down_proj": {0}}
    engine.activate_adapter("qv-only", 0)  # replaces rank16: the projections it skips drop to 0
    assert ranks(0) == {"q_proj": {8}, "k_proj": {0}, "v_proj": {8}, "o_proj": {0},
                        "gate_proj": {0}, "up_proj": {0}, "down_proj": {0}}
    for where in slots.projections:  # the rows past a slot's rank are zero, as promised
        for slot in (0, 1):
            lora_a, lora_b, slot_ranks = slots.buffers(where, slot)
            rank = int(slot_ranks[0])
            assert not lora_a[:, rank:].any() and not lora_b[:, :, rank:].any()
    engine.unload_adapter("rank8-attention")  # empties its slot
    assert set().union(*ranks(1).values()) == {0}


def test_load_is_idempotent_but_one_id_names_one_directory(setup: Setup) -> None:
    engine = _engine(setup)
    first = engine.lora.load("a", "local", str(setup.adapters["rank4"]))
    assert engine.lora.load("a", "local", str(setup.adapters["rank4"])) == first
    with pytest.raises(ValueError, match="already loaded from"):
        engine.lora.load("a", "local", str(setup.adapters["rank16"]))


def test_bad_slot_operations(setup: Setup) -> None:
    engine = _engine(setup)
    engine.lora.load("a", "local", str(setup.adapters["rank4"]))
    with pytest.raises(ValueError, match="slot 2 is out of range"):
        engine.activate_adapter("a", 2)
    with pytest.raises(ValueError, match="'b' is not loaded"):
        engine.activate_adapter("b", 0)


def test_no_slots_means_adapters_are_disabled(setup: Setup) -> None:
    engine = Engine(str(setup.base_dir), "tiny", dtype="float32", device="cpu", cpu_kv_cache_gib=0.01)
    with pytest.raises(ValueError, match="call warmup first"):
        engine.lora.load("a", "local", str(setup.adapters["rank4"]))
    with pytest.raises(ValueError, match="max_lora_rank must be positive"):
        engine.warmup(128, 64, 8, max_active_adapters=2, max_lora_rank=0)
    engine.warmup(128, 64, 8)
    with pytest.raises(ValueError, match="disabled"):
        engine.lora.load("a", "local", str(setup.adapters["rank4"]))
    with pytest.raises(ValueError, match="no adapter slots"):
        engine.prefill(1, [_request(0, "a")])


def test_weights_are_kept_in_the_serving_dtype(setup: Setup) -> None:
    engine = _engine(setup, dtype="bfloat16")
    engine.lora.load("a", "local", str(setup.adapters["rank16"]))
    engine.activate_adapter("a", 0)
    host = engine.lora.registry.get("a")
    assert {t.dtype for pair in host.weights.values() for t in pair} == {torch.bfloat16}
    part = engine.lora.slots.classes[0].parts[(0, "q_proj")]
    assert part.lora_a.dtype == part.lora_b.dtype == torch.bfloat16 and part.scaling.dtype == torch.float32
    # Rank 16 fills the slot's first 16 rank rows; peft's own bf16-rounded A is what is there.
    reference = peft_reference(setup.base_dir, setup.adapters["rank16"])
    peft_a = reference.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight
    torch.testing.assert_close(part.lora_a[0, :16], peft_a.to(torch.bfloat16), atol=0, rtol=0)
    assert engine.prefill(1, [_request(0, "a")]).generations


def test_activation_says_whether_the_host_cache_held_the_weights(setup: Setup) -> None:
    """The router counts host-cache hits and misses from this answer (ActivateAdapterResponse)."""
    engine = _engine(setup, slots=1, max_cpu_adapters=1)
    engine.lora.load("a", "local", str(setup.adapters["rank4"]))
    assert engine.activate_adapter("a", 0) is True
    engine.lora.load("b", "local", str(setup.adapters["rank8-attention"]))
    assert engine.activate_adapter("b", 0) is True  # "a" leaves the slot for host memory
    assert "a" in engine.lora.registry.host  # the one unpinned place is a's
    engine.lora.load("c", "local", str(setup.adapters["rank16"]))  # takes it
    assert "a" not in engine.lora.registry.host
    assert engine.activate_adapter("a", 0) is False  # read from disk again
    assert engine.activate_adapter("a", 0) is True  # the slot holds it already


def test_files_changed_in_place_are_refused_when_read_again(setup: Setup, tmp_path: Path) -> None:
    """An adapter the host cache dropped is read from its directory again; if its files were
    replaced meanwhile, those are other weights under a loaded id, refused until it is reloaded."""
    import shutil

    served = tmp_path / "served"
    shutil.copytree(setup.adapters["rank4"], served)
    engine = _engine(setup, slots=1, max_cpu_adapters=1)
    engine.lora.load("a", "local", str(served))
    engine.lora.load("b", "local", str(setup.adapters["rank8-attention"]))  # "a" leaves host memory
    assert "a" not in engine.lora.registry.host
    # The same files again: read back, the same adapter.
    assert engine.activate_adapter("a", 0) is False
    engine.activate_adapter("b", 0)
    engine.lora.load("c", "local", str(setup.adapters["rank16"]))  # "a" leaves host memory again
    assert "a" not in engine.lora.registry.host
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(setup.adapters["qv-only"] / name, served / name)
    with pytest.raises(ValueError, match="its files changed since it was loaded"):
        engine.activate_adapter("a", 0)
    # Unloaded and loaded again, it is the new adapter.
    engine.unload_adapter("a")
    engine.lora.load("a", "local", str(served))
    assert engine.activate_adapter("a", 0) is True
    assert engine.lora.registry.info("a").target_modules == ["q_proj", "v_proj"]


# ---- host LRU ------------------------------------------------------------------------------


def _fake(adapter_id: str) -> LoadedAdapter:
    return LoadedAdapter(adapter_id=adapter_id, path="/x", rank=1, scaling=1.0, weights={})


def test_host_cache_evicts_least_recently_used_and_never_a_pinned_one() -> None:
    """The bound counts unpinned adapters only: the slots' adapters are kept besides it."""
    cache = HostAdapterCache(2)
    assert cache.put(_fake("a")) == [] and cache.put(_fake("b")) == []
    assert cache.put(_fake("c")) == ["a"]
    assert cache.get("b") is not None  # b is now the most recently used
    assert cache.put(_fake("d")) == ["c"]
    b = cache.get("b")
    assert b is not None and cache.pin(b) == []
    assert cache.put(_fake("e")) == []  # pinned, b leaves room for two others
    assert cache.put(_fake("f")) == ["d"]  # b is the oldest but pinned
    assert cache.ids() == ["b", "e", "f"]
    assert cache.unpin("b") == ["b"]  # unpinned, it is the least recently used of three
    assert cache.ids() == ["e", "f"]
    cache.remove("e")
    assert "e" not in cache and len(cache) == 1
    with pytest.raises(ValueError):
        HostAdapterCache(0)


def test_an_adapter_evicted_between_activation_and_pin_is_put_back() -> None:
    """Activation takes an adapter from the cache (or disk), copies it into a slot, then pins it;
    a load on another thread can evict it in between when pinned adapters fill the cache. The
    pin puts it back: an adapter in a slot always has its host copy."""
    cache = HostAdapterCache(1)
    cache.put(_fake("in-slot"))
    cache.pin(_fake("in-slot"))
    activating = _fake("activating")
    assert cache.put(activating) == []  # the pinned one does not count
    assert cache.put(_fake("loaded-meanwhile")) == ["activating"]
    assert cache.pin(activating) == []  # back, and pinned: it does not count either
    assert cache.ids() == ["in-slot", "loaded-meanwhile", "activating"]
    assert cache.get("activating") is activating


def test_unloading_the_evicted_occupant_during_a_copy_keeps_the_new_adapter(setup: Setup) -> None:
    """The router evicts X when it starts copying Y into X's slot, so it may unload X while the
    copy runs: the unload must not clear the slot Y is being copied into."""
    import threading
    from contextlib import contextmanager

    engine = _engine(setup)
    engine.lora.load("x", "local", str(setup.adapters["rank4"]))
    engine.lora.load("y", "local", str(setup.adapters["qv-only"]))
    engine.activate_adapter("x", 0)
    slots = engine.lora.slots
    assert slots is not None
    inside, release = threading.Event(), threading.Event()

    @contextmanager
    def held() -> Iterator[None]:
        inside.set()  # the copy holds the slots' lock from here on
        assert release.wait(60)
        yield

    slots._on_copy_stream = held  # type: ignore[method-assign]
    copy = threading.Thread(target=engine.activate_adapter, args=("y", 0))
    copy.start()
    assert inside.wait(60)
    unload = threading.Thread(target=engine.unload_adapter, args=("x",))
    unload.start()
    release.set()
    copy.join(60)
    unload.join(60)
    assert slots.adapter_in(0) == "y" and "x" not in engine.lora.registry
    outputs = [engine.prefill(1, [_request(0, "y")]).generations[0].token_id]
    outputs += [engine.decode([1]).generations[0].token_id for _ in range(NEW_TOKENS - 1)]
    assert_greedy_matches(outputs, setup.expected["qv-only"], "y after the racing unload")


def test_an_adapter_moved_to_another_slot_leaves_its_old_one(setup: Setup) -> None:
    """Activations run beside the steps, so a copy of an adapter into a new slot can reach the
    shard before the copy that overwrites its old one: the old slot is emptied at once, and new
    requests are bound to the new one."""
    engine = _engine(setup)
    engine.lora.load("x", "local", str(setup.adapters["rank16"]))
    engine.activate_adapter("x", 0)
    engine.activate_adapter("x", 1)
    slots = engine.lora.slots
    assert slots is not None
    assert (slots.adapter_in(0), slots.slot_of("x")) == (None, 1)
    assert all(not slots.buffers(where, 0)[0].any() and int(slots.buffers(where, 0)[2][0]) == 0
               for where in slots.projections)
    outputs = [engine.prefill(1, [_request(0, "x")]).generations[0].token_id]
    outputs += [engine.decode([1]).generations[0].token_id for _ in range(NEW_TOKENS - 1)]
    assert_greedy_matches(outputs, setup.expected["rank16"], "moved")


def test_rank_classes_hold_adapters_up_to_their_rank_in_smaller_buffers(setup: Setup) -> None:
    """Slots of rank 8, 16 and 8 (two rank classes, interleaved: slot 2 is row 1 of the rank-8
    class). A rank-16 adapter is refused by a rank-8 slot without leaving its own; three
    adapters, one per slot, generate peft's tokens in one batch; unloading one leaves its
    class neighbour serving; a rank-8 slot's buffers are half a rank-16 slot's."""
    engine = Engine(str(setup.base_dir), "tiny", dtype="float32", device="cpu", cpu_kv_cache_gib=0.01)
    with pytest.raises(ValueError, match="at least one of them max_lora_rank=16"):
        engine.warmup(128, 64, 8, max_active_adapters=3, max_lora_rank=16, slot_ranks=[8, 8, 8])
    engine.warmup(128, 64, 8, max_active_adapters=3, max_lora_rank=16, slot_ranks=[8, 16, 8])
    slots = engine.lora.slots
    assert slots is not None and [slots.rank_of(s) for s in range(3)] == [8, 16, 8]
    assert slots.ranks.local == (0, 0, 1)
    for where in slots.projections:
        small, large = slots.buffers(where, 2), slots.buffers(where, 1)
        assert 2 * small[0].nbytes == large[0].nbytes and 2 * small[1].nbytes == large[1].nbytes
    kinds = {0: "rank4", 1: "rank16", 2: "rank8-attention"}
    for kind in kinds.values():
        engine.lora.load(kind, "local", str(setup.adapters[kind]))
    engine.activate_adapter("rank16", 1)
    with pytest.raises(ValueError, match="'rank16' has rank 16, but slot 2 holds ranks up to 8"):
        engine.activate_adapter("rank16", 2)
    assert (slots.slot_of("rank16"), slots.adapter_in(2)) == (1, None)
    for slot, kind in kinds.items():
        engine.activate_adapter(kind, slot)

    def generate(slot_kinds: dict[int, str], batch_id: int) -> dict[int, list[int]]:
        outputs: dict[int, list[int]] = {slot: [] for slot in slot_kinds}
        step = engine.prefill(batch_id, [_request(slot, kind) for slot, kind in slot_kinds.items()])
        for _ in range(NEW_TOKENS):
            for g in step.generations:
                outputs[g.request_id].append(g.token_id)
            if len(outputs[next(iter(outputs))]) == NEW_TOKENS:
                break
            step = engine.decode([batch_id])
        engine.clear_cache(batch_id)
        return outputs

    for slot, tokens in generate(kinds, 1).items():
        assert_greedy_matches(tokens, setup.expected[kinds[slot]], f"{kinds[slot]} in slot {slot}")
    engine.unload_adapter("rank4")  # row 0 of the rank-8 class: row 1 keeps its adapter
    assert_greedy_matches(generate({2: "rank8-attention"}, 2)[2], setup.expected["rank8-attention"],
                          "rank8-attention after its class neighbour left")


def test_warmup_runs_every_rank_class_through_prefill_and_decode(
        setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each class's kernels are compiled and their memory counted at warmup, even when the dry
    run's prefill has fewer sequences than there are classes (here one)."""
    ran: set[tuple[int, bool]] = set()
    add = LoraProjection.add

    def recording(self: LoraProjection, y: torch.Tensor, x: torch.Tensor, meta: LoraBatchMeta) -> None:
        if meta.has_lora:
            ran.add((self.lora_a[0].shape[1], meta.is_decode))
        add(self, y, x, meta)

    monkeypatch.setattr(LoraProjection, "add", recording)
    engine = Engine(str(setup.base_dir), "tiny", dtype="float32", device="cpu", cpu_kv_cache_gib=0.01)
    engine.warmup(32, 64, 2, max_active_adapters=4, max_lora_rank=16, slot_ranks=[4, 8, 8, 16])
    assert ran == {(rank, decode) for rank in (4, 8, 16) for decode in (False, True)}
