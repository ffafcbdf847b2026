"""GenerationBackend: the one owner of the weight version, the engine lock, the context check."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading

import pytest
import torch

from ar_torchrl.backends import (
    BackendCapabilities,
    Completion,
    ContextLengthError,
    EpisodeCache,
    GenerationBackend,
    SamplingParams,
    TransformersBackend,
)
from ar_torchrl.models.tiny import build_tiny_qwen3
from ar_torchrl.weight_sync import WeightSyncError, named_policy_tensors

torch.set_num_threads(1)
TENSORS = [("w", torch.ones(2))]


class Sender:
    """A WeightSender that records, or fails in a chosen way."""

    def __init__(self, error: BaseException | None = None, gate: threading.Event | None = None):
        self.error, self.gate, self.versions, self.closed = error, gate, [], 0

    def send(self, named_tensors, version):
        list(named_tensors)
        if self.gate is not None:
            self.gate.wait(10)
        if self.error is not None:
            raise self.error
        self.versions.append(version)

    def close(self):
        self.closed += 1


class Echo(GenerationBackend):
    """Repeats the last prompt token; records when it generated."""

    def __init__(self, sender=None, context: int | None = None):
        super().__init__(sender)
        self.context, self.events = context, []

    @property
    def context_length(self):
        return self.context

    def _generate(self, prompts, n, sampling):
        self.events.append("generate")
        return [
            Completion(i, p[-1:], [-0.5], "length") for i, p in enumerate(prompts) for _ in range(n)
        ]


def test_version_starts_at_zero_changes_only_after_a_successful_sync():
    sender = Sender()
    engine = Echo(sender)
    assert engine.policy_version == 0
    assert {c.policy_version for c in engine.generate([[1], [2]], 2, SamplingParams())} == {0}
    engine.sync_weights(TENSORS, version=4)
    assert engine.policy_version == 4 and sender.versions == [4]
    out = engine.generate([[1], [2]], 2, SamplingParams())
    assert [c.prompt_index for c in out] == [0, 0, 1, 1] and {c.policy_version for c in out} == {4}
    with pytest.raises(AttributeError):
        engine.policy_version = 5  # read-only: nothing outside the backend writes it
    engine.close()
    assert sender.closed == 1


def test_failed_sync_keeps_the_version_and_generation_continues():
    engine = Echo(Sender(error=WeightSyncError("refused before sending", partial=False)))
    with pytest.raises(
        WeightSyncError,
        match=r"Echo: weight sync to version 1 failed \(refused before sending\); the engine keeps policy_version 0$",
    ) as info:
        engine.sync_weights(TENSORS, version=1)
    assert not info.value.partial and engine.policy_version == 0
    assert engine.generate([[1]], 1, SamplingParams())[0].policy_version == 0


@pytest.mark.parametrize(
    "error", [WeightSyncError("half sent", partial=True), RuntimeError("boom")]
)
def test_partial_sync_blocks_generation_until_a_sync_succeeds(error):
    sender = Sender(error=error)
    engine = Echo(sender)
    with pytest.raises(WeightSyncError, match="may hold a partial update: sync again") as info:
        engine.sync_weights(TENSORS, version=1)
    assert info.value.partial and engine.policy_version == 0
    with pytest.raises(
        WeightSyncError,
        match=r"last weight sync failed part-way \((half sent|RuntimeError: boom)\)",
    ):
        engine.generate([[1]], 1, SamplingParams())
    sender.error = None
    engine.sync_weights(TENSORS, version=1)
    assert engine.generate([[1]], 1, SamplingParams())[0].policy_version == 1


def test_a_partial_sync_is_said_before_the_engine_is_asked_its_context_length():
    """A server killed mid-sync cannot answer /server_info: generate names the partial sync,
    not the unreachable server (found when the SGLang router test ran on its own)."""

    class Dying(Echo):
        dead = False

        @property
        def context_length(self):
            if self.dead:
                raise ConnectionError("the engine is gone")
            return 64

    engine = Dying(Sender(error=WeightSyncError("half sent", partial=True)))
    with pytest.raises(WeightSyncError):
        engine.sync_weights(TENSORS, version=1)
    engine.dead = True
    with pytest.raises(WeightSyncError, match="failed part-way .*sync again before generating"):
        engine.generate([[1]], 1, SamplingParams())
    assert engine.events == []


def test_no_sender_cannot_sync():
    with pytest.raises(WeightSyncError, match="Echo has no weight sender"):
        Echo().sync_weights(TENSORS, 1)


def test_generation_waits_for_an_in_flight_sync():
    gate = threading.Event()
    engine = Echo(Sender(gate=gate))
    syncing = threading.Thread(target=engine.sync_weights, args=(TENSORS, 7))
    syncing.start()
    result = {}
    generating = threading.Thread(
        target=lambda: result.update(out=engine.generate([[3]], 1, SamplingParams()))
    )
    generating.start()
    generating.join(0.5)
    assert generating.is_alive() and engine.events == []  # blocked by the sync
    gate.set()
    syncing.join(10), generating.join(10)
    assert result["out"][0].policy_version == 7  # never a batch from the old weights mid-sync


def test_context_length_is_enforced_naming_the_prompt():
    engine = Echo(context=10)
    engine.generate([[1] * 6], 1, SamplingParams(max_new_tokens=4))  # exactly fits
    with pytest.raises(
        ContextLengthError,
        match=r"Echo: prompts \(index, tokens\) \[\(1, 7\)\] plus max_new_tokens=4 exceed the model's context of 10 tokens",
    ):
        engine.generate([[1] * 6, [1] * 7], 1, SamplingParams(max_new_tokens=4))
    assert engine.events == ["generate"]


def test_trainside_refuses_prompts_longer_than_max_position_embeddings():
    model = build_tiny_qwen3(99, seed=0)
    limit = model.config.max_position_embeddings
    backend = TransformersBackend(model)
    assert backend.context_length == limit
    with pytest.raises(ContextLengthError, match=f"exceed the model's context of {limit} tokens"):
        backend.generate([[5] * (limit - 1)], 1, SamplingParams(max_new_tokens=2))


def test_bad_generate_arguments():
    with pytest.raises(ValueError, match=r"prompts \[1\] are empty"):
        Echo().generate([[1], []], 1, SamplingParams())
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        Echo().generate([[1]], 0, SamplingParams())


def test_trainside_sync_through_the_base_class():
    trainer, engine = (
        build_tiny_qwen3(99, seed=1),
        TransformersBackend(build_tiny_qwen3(99, seed=0)),
    )
    engine.sync_weights(named_policy_tensors(trainer), version=2)
    assert engine.policy_version == 2
    assert torch.equal(engine.model.lm_head.weight, trainer.lm_head.weight)


def _imported(*imports: str) -> list[list[str]]:
    """``requests`` and the SGLang client's modules that are loaded after importing each
    comma-separated module list in turn, in one fresh interpreter (each list on top of the ones
    before it)."""
    step = (
        "import {}; "
        "found.append(sorted(m for m in sys.modules if m == 'requests' "
        "or m.startswith('ar_torchrl.backends.sglang')))"
    )
    code = "; ".join(["import sys, json; found = []", *(step.format(m) for m in imports)])
    proc = subprocess.run(
        [sys.executable, "-c", code + "; print(json.dumps(found))"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_importing_the_library_does_not_import_requests():
    """The SGLang client (and its HTTP stack) is imported only when used. TorchRL imports Ray when
    Ray is installed (the [ray] extra), and Ray imports requests: importing the library on top of
    TorchRL's own modules adds nothing to what they loaded."""
    torchrl_alone, with_library = _imported(
        "torchrl.envs, torchrl.collectors, torchrl.objectives",
        "ar_torchrl.objectives, ar_torchrl.envs, ar_torchrl.collectors, ar_torchrl.backends",
    )
    assert with_library == torchrl_alone
    assert torchrl_alone == ([] if importlib.util.find_spec("ray") is None else ["requests"])


# ----------------------------------------------------------------------------- capabilities
def test_engines_declare_their_capabilities():
    from ar_torchrl.backends import BackendCapabilities, SGLangBackend

    assert Echo.capabilities == BackendCapabilities()  # the defaults: nothing optional
    assert TransformersBackend.capabilities == BackendCapabilities(
        partial_rollouts=True, sampler_state=True, episode_cache=True
    )
    assert SGLangBackend.capabilities == BackendCapabilities(
        partial_rollouts=True, memory_release=True
    )
    echo = Echo(Sender())
    assert (echo.weight_dtype, echo.context_length, echo.shares_trainer_weights) == (
        None,
        None,
        False,
    )
    assert echo.state_dict() == {} and echo.load_state_dict({}) is None
    with pytest.raises(
        ValueError, match=r"Echo cannot interrupt its generation: .*partial_rollouts"
    ):
        echo.partial_rollouts = True
    with pytest.raises(ValueError, match=r"Echo does not release its memory \(capabilities"):
        echo.release_memory()
    with pytest.raises(ValueError, match=r"Echo keeps no sampling state .* got one with \['rng'\]"):
        echo.load_state_dict({"rng": 1})
    share = TransformersBackend(build_tiny_qwen3(99), mode="share")
    assert (
        share.shares_trainer_weights and not TransformersBackend(share.model).shares_trainer_weights
    )


# ----------------------------------------------------------------------------- episode caches
class Keeper(Echo):
    """Declares an episode cache and keeps nothing: the base class prefills every context."""

    capabilities = BackendCapabilities(episode_cache=True)


def test_episode_caches_are_refused_where_not_declared_and_checked_where_declared():
    sampling = SamplingParams(max_new_tokens=1)
    with pytest.raises(
        ValueError, match=r"Echo keeps no episode cache \(capabilities.episode_cache"
    ):
        Echo().generate([[1]], 1, sampling, episodes=EpisodeCache(), episode_ids=[0])
    keeper, cache = Keeper(Sender()), EpisodeCache()
    with pytest.raises(ValueError, match=r"episodes= and episode_ids= go together"):
        keeper.generate([[1]], 1, sampling, episodes=cache)
    for prompts, n, ids in (([[1]], 2, [0]), ([[1]], 1, [0, 1]), ([[1], [2]], 1, [3, 3])):
        with pytest.raises(ValueError, match=r"n must be 1 and episode_ids one distinct id per"):
            keeper.generate(prompts, n, sampling, episodes=cache, episode_ids=ids)
    out = keeper.generate([[1, 2], [3]], 1, sampling, episodes=cache, episode_ids=[5, 9])
    assert [c.token_ids for c in out] == [[2], [3]] and cache.policy_version == 0
    cache.states[5] = "kept by version 0"
    keeper.sync_weights(TENSORS, version=4)  # new weights: what was kept is stale
    keeper.generate([[1]], 1, sampling, episodes=cache, episode_ids=[5])
    assert len(cache) == 0 and cache.policy_version == 4
    cache.states[5] = "kept by version 4"
    keeper.generate([[1]], 1, sampling, episodes=cache, episode_ids=[5])
    assert 5 in cache  # same weights: kept


def test_the_old_partial_rollouts_declaration_still_works():
    with pytest.warns(
        DeprecationWarning, match=r"capabilities = BackendCapabilities\(partial_rollouts=True\)"
    ):

        class Old(Echo):
            supports_partial_rollouts = True

    assert Old.capabilities.partial_rollouts and Old().supports_partial_rollouts
    Old().partial_rollouts = True  # allowed: declared


def test_the_recipe_collector_and_envs_read_declared_capabilities_not_probes():
    """No ``getattr(<backend>, ...)`` / ``hasattr(<backend>, ...)`` probe is left."""
    from pathlib import Path

    import ar_torchrl

    root = Path(ar_torchrl.__file__).parent
    probes = [
        f"{path.relative_to(root)}:{n}"
        for folder in ("recipes", "collectors", "envs")
        for path in (root / folder).rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if ("getattr(" in line or "hasattr(" in line) and "backend" in line
    ]
    assert probes == [], probes
