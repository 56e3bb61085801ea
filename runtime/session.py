"""A conversation: a Wasm guest (control plane) driving a model in MLX (compute).

One :class:`Session` = a chat guest instance + its KV cache (mlx-lm cache
objects) + the token history + the messages. The guest decides everything that
is said: per step it asks the host to run the model over what is pending
(``kv_prefill``/``kv_decode``), reads the logits from its own memory, samples
with its own seeded PRNG and applies stop rules. The host streams the tokens it
returns and enforces hard limits (max tokens, context, deadline).

Between two steps the whole conversation is the KV cache, the history and the
guest's memory: that is where checkpoints and migrations cut.
"""

from __future__ import annotations

import contextlib
import logging
import struct
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .checkpoint.snapshot import cache_kind
from .errors import ConfigError, GuestAbiError, GuestError, KvferryError, PromptTooLongError, SessionError
from .guest import GuestLimits, GuestModule, MemoryImage
from .params import SamplingParams, SessionOptions
from .textstream import TextStream
from .turn import TokenEvent, TurnState, TurnStats, run_reply

log = logging.getLogger("kvferry.session")


@dataclass
class SessionState:
    """Everything a session is between two steps (what a checkpoint carries).
    ``caches`` are the live mlx-lm cache objects (their own ``state`` holds the
    arrays); ``turn`` is a reply in progress, as plain data."""
    id: str
    sampling: SamplingParams
    options: SessionOptions
    context: int
    caches: list
    history: list[int]
    messages: list[dict]
    turn: dict | None
    module: GuestModule
    memory: MemoryImage | None = None
    kv_epoch: int = 0
    owner: str = ""  # the name of the key that created it (kvferry.keys)


def make_guest(host: Any, module: GuestModule, options: SessionOptions, session_id: str, ahead: Any = None) -> Any:
    """The guest instance of session ``session_id`` (``options`` already held to the
    host's policy): ``ahead`` (one made earlier, by a restore) if it fits, else a new one."""
    limits = GuestLimits(memory_cap=options.memory_cap, deadline_ms=options.deadline_ms)
    if ahead is not None and ahead.module.sha256 == module.sha256 and ahead.limits == limits:
        return ahead
    if ahead is not None:
        ahead.close()  # made for other terms: not this session's
    return host.engine.instantiate(module, f"{Path(module.label).stem}#{session_id}", limits)


class Session:
    """One conversation. Create through :meth:`kvferry.host.ModelHost.create_session`;
    ``host`` is that ModelHost (lm, engine, guest modules, compute lock)."""

    def __init__(self, host: Any, guest_path: "str | Path | GuestModule | None",
                 sampling: SamplingParams, options: SessionOptions, session_id: str | None = None,
                 *, configure: bool = True, guest: Any = None):
        self.host = host
        self.lm = host.lm
        self.id = session_id or uuid.uuid4().hex[:12]
        sampling, options = host.policy.clamp(sampling, options)  # the host's limits, however it came
        self.sampling, self.options = sampling, options
        context = int(self.lm.config.get("max_position_embeddings") or 4096)
        options.validate(context)
        sampling.validate()
        self.context = options.ctx or context
        head_dim = self.lm.head_dim
        if options.kv_bits is not None and head_dim % options.kv_group_size:
            raise ConfigError(f"--kv-bits: the model's head dim {head_dim} is not a multiple of the "
                              f"KV group size {options.kv_group_size}")
        self.vocab_size = int(self.lm.config["vocab_size"])
        self.eos = sorted(self.lm.eos_token_ids)
        module = guest_path if isinstance(guest_path, GuestModule) else host.guest_module(guest_path)
        self.guest = make_guest(host, module, options, self.id, ahead=guest)
        self.guest.model = self  # the ModelBinding the ABI's model functions call
        self.cache = self._make_cache()
        self.history: list[int] = []  # tokens in the KV cache, in order
        self.messages: list[dict] = []
        self._logits = None
        self._top1: tuple[Any, int] | None = None  # the logits' greedy token, from the step (kvferry.top1)
        self.last = TurnStats()
        self.turn: TurnState | None = None
        self.kv_epoch = 0  # bumped whenever cached KV is rewritten (trim/reset), not just appended
        self.step_seconds = 0.0  # recent time of one decode step (paces a live migration)
        # Model work a guest may ask for now: prompt tokens to prefill (what is pending
        # of this turn's prompt, in begin or a step) and decodes (one per step); nothing
        # in any other export. Model time is the host's, so it is rationed here.
        self._prefill_budget = self._decode_budget = 0
        self._prompt_left = 0
        self._ahead: tuple[int, Any, Any] | None = None  # a decode the host ran ahead (guest_step)
        # (token, logits) of a step the host it came from ran (a checkpoint's ahead): its first step
        self.landed_step: tuple[int, Any] | None = None
        self.last_used = time.monotonic()  # idle expiry (serve --session-ttl)
        self.owner = ""  # the name of the key that created it (kvferry.keys)
        self.closed = False
        if configure:  # restored sessions bring their guest memory (config, PRNG) instead
            self.configure(sampling)

    # -- construction ----------------------------------------------------------
    def _make_cache(self) -> list:
        from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

        n = len(self.lm.model.layers)
        o = self.options
        if o.kv_bits is not None:
            return [QuantizedKVCache(group_size=o.kv_group_size, bits=o.kv_bits) for _ in range(n)]
        if o.ctx is not None:
            return [RotatingKVCache(max_size=o.ctx, keep=4) for _ in range(n)]
        return [KVCache() for _ in range(n)]

    def configure(self, sampling: SamplingParams) -> None:
        """Send sampling parameters to the guest (kvferry_chat_config)."""
        sampling.validate()
        stops = [s.encode() for s in sampling.stop]
        ptr = self._buffer(64 + sum(len(s) for s in stops))
        offs, lens, at = [], [], ptr + 64
        for s in stops:
            self.guest.write(at, s)
            offs.append(at)
            lens.append(len(s))
            at += len(s)
        offs += [0] * (4 - len(offs))
        lens += [0] * (4 - len(lens))
        flags = 1 if sampling.ignore_eos else 0
        cfg = struct.pack("<ffiiQI4I4II", sampling.temperature, sampling.top_p, sampling.top_k,
                          sampling.max_tokens, sampling.seed, len(stops), *offs, *lens, flags)
        self.guest.write(ptr, cfg)
        rc = self.guest.call("kvferry_chat_config", ptr)
        if rc < 0:
            raise SessionError(f"guest '{self.guest.name}' rejected the sampling config (code {rc})")
        self.sampling = sampling

    def _buffer(self, size: int) -> int:
        ptr = self.guest.call("kvferry_buffer", size) & 0xFFFFFFFF
        if ptr == 0:
            raise SessionError(f"guest '{self.guest.name}' has no buffer for {size} bytes of input")
        return ptr

    # -- ModelBinding (called by the guest through the ABI) ----------------------
    def info(self) -> dict:
        return {"vocab_size": self.vocab_size, "context": self.context,
                "n_tokens": len(self.history), "eos": self.eos}

    def _spend_prefill(self, n: int) -> None:
        if n > self._prefill_budget:
            raise GuestAbiError(f"kv_prefill: {n} tokens asked, {self._prefill_budget} of the prompt are "
                                "pending (a guest prefills only the prompt it was given)")
        self._prefill_budget -= n

    def _spend_decode(self) -> None:
        if self._decode_budget < 1:
            raise GuestAbiError("kv_decode: one decode per step, and this one has had it "
                                "(or this export may not run the model)")
        self._decode_budget -= 1

    def prefill(self, tokens: list[int]) -> None:
        self._spend_prefill(len(tokens))
        self._prompt_left = max(0, self._prompt_left - len(tokens))
        if self.options.ctx is None and len(self.history) + len(tokens) > self.context:
            raise PromptTooLongError(f"context full: {len(self.history)} + {len(tokens)} tokens "
                                     f"exceed the context of {self.context}")
        if tokens:  # the host's step scheduler prefills them in chunks beside the running decode batch
            self._logits, self._top1 = self.host.steps.run(self, tokens)

    def decode(self, token: int) -> None:
        self._spend_decode()
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            if ahead[0] == token:  # the host ran this step already (guest_step)
                self._logits, self._top1 = ahead[1], ahead[2]
                return
            self._take_back()
        if self.options.ctx is None and len(self.history) + 1 > self.context:
            raise SessionError(f"context full ({self.context} tokens)")
        self._logits, self._top1 = self.host.steps.run(self, [token])  # one row of the host's next decode batch

    def ran_ahead(self, token: int) -> bool:
        return self._ahead is not None and self._ahead[0] == token

    def logits(self):
        if self._logits is None:
            raise SessionError("no logits yet: the guest read logits before any prefill/decode")
        return self._logits

    def top1(self) -> tuple[int, int] | None:
        """The logits' greedy token and the float32 bits of its logit, as the step
        computed them on the device; None where the step did not."""
        if self._top1 is None:
            return None
        top, row = self._top1
        return top.row(row)

    def token_text(self, token: int) -> bytes:
        return self.host.token_bytes(token)

    # -- turns -----------------------------------------------------------------
    def send(self, text: str, role: str = "user", max_tokens: int = 0) -> Iterator[TokenEvent]:
        """Add a message and stream the guest's reply (a chat turn); ``max_tokens``
        caps this reply below the session's limit."""
        if max_tokens < 0:
            raise SessionError(f"max_tokens must be positive, not {max_tokens}")
        self._check_open()
        limit = self.host.policy.max_message_bytes
        if (n := len(text.encode("utf-8", "replace"))) > limit:
            raise PromptTooLongError(f"message is {n} bytes, this host takes at most {limit}")
        messages = [*self.messages, {"role": role, "content": text}]
        try:
            tokens = list(self.lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        except Exception as e:
            raise SessionError(f"chat template failed: {e}") from None
        events = self._turn(tokens, record=True, max_tokens=max_tokens)
        self.messages = messages  # only a turn that began: a refused prompt leaves no trace
        return events

    def complete(self, prompt: str | list[int]) -> Iterator[TokenEvent]:
        """Raw completion: continue ``prompt`` (text or ids) with no chat template."""
        self._check_open()
        ids = list(prompt) if not isinstance(prompt, str) else list(
            self.lm.tokenizer.encode(prompt, add_special_tokens=False))
        return self._turn(list(self.history) + ids, record=False)

    def _check_open(self) -> None:
        if self.closed:
            raise SessionError(f"session {self.id} is closed")

    def _sync_history(self, full: list[int]) -> list[int]:
        """Trim the KV cache to the common prefix with ``full``; return the new tokens."""
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        common = 0
        for a, b in zip(self.history, full):
            if a != b:
                break
            common += 1
        if common == len(full):  # nothing new: re-run the last token to get logits
            common = max(0, common - 1)
        drop = len(self.history) - common
        if drop:
            self.kv_epoch += 1
            if can_trim_prompt_cache(self.cache) and trim_prompt_cache(self.cache, drop) == drop:
                del self.history[common:]
            else:  # a rotated cache cannot be trimmed: rebuild it
                self.cache = self._make_cache()
                self.history = []
                common = 0
        return full[common:]

    def _turn(self, full: list[int], record: bool, max_tokens: int = 0) -> Iterator[TokenEvent]:
        self.guest.check_alive()  # (a turn a failure ended stays "in progress": say what ended it)
        if self.turn is not None:
            raise SessionError(f"session {self.id}: a turn is already in progress")
        # With --ctx the cache slides, so only this turn's new tokens must fit.
        if self.options.ctx is None and len(full) >= self.context:
            raise PromptTooLongError(f"prompt is {len(full)} tokens, the context holds {self.context}")
        new = self._sync_history(full)
        if self.options.ctx is not None and len(new) >= self.context:
            raise PromptTooLongError(f"prompt is {len(new)} tokens, the context holds {self.context}")
        ptr = self._buffer(4 * len(new))
        self.guest.write(ptr, np.asarray(new, dtype=np.int32))
        self._prompt_left = self._prefill_budget = len(new)
        try:
            rc = self.guest.call("kvferry_chat_begin", ptr, len(new))
        finally:
            self._prefill_budget = 0
        if rc < 0:
            raise SessionError(f"guest '{self.guest.name}' refused a turn of {len(new)} tokens")
        self.host.metrics.prompt_tokens.inc(len(new))
        self.turn = TurnState(n_prompt=len(new), record=record, tokens=[], texts=[],
                              stream=TextStream(self.lm.tokenizer, self.sampling.stop), max_tokens=max_tokens)
        return self._steps()

    def continue_turn(self, from_index: int = 0) -> Iterator[TokenEvent]:
        """Continue the turn in progress (e.g. after a migration): first re-send the
        tokens from ``from_index`` the client has not seen, then generate on."""
        self.guest.check_alive()
        if self.turn is None:
            raise SessionError(f"session {self.id} has no turn in progress")
        return self._steps(replay_from=from_index)

    def restore_turn(self, n_prompt: int, record: bool, tokens: list[int], texts: list[str],
                     max_tokens: int = 0) -> None:
        stream = TextStream(self.lm.tokenizer, self.sampling.stop)
        for t in tokens:
            stream.det.add_token(t)
        stream.emitted = sum(len(x) for x in texts)
        self.turn = TurnState(n_prompt=n_prompt, record=record, tokens=list(tokens), texts=list(texts),
                              stream=stream, max_tokens=max_tokens)
        self._prompt_left = 0 if tokens else n_prompt

    def _steps(self, replay_from: int | None = None) -> Iterator[TokenEvent]:
        try:
            yield from self._turn_steps(replay_from)
        except KvferryError:
            raise
        except Exception:  # a bug ended the turn: the session takes its next message as if it never began
            turn, self.turn = self.turn, None
            if turn is not None and turn.record and self.messages:
                self.messages.pop()  # its message (the next turn's prompt re-syncs the KV to what is kept)
            raise

    def _turn_steps(self, replay_from: int | None) -> Iterator[TokenEvent]:
        turn = self.turn
        if replay_from is not None:
            for i in range(max(0, replay_from), len(turn.tokens)):
                yield TokenEvent(turn.tokens[i], turn.texts[i], i)
        admission = self.host.admission
        left = min(turn.max_tokens or self.sampling.max_tokens, self.sampling.max_tokens) - len(turn.tokens)
        grow = (self._prompt_left + max(0, left)) * self.kv_token_bytes()
        admission.enter(self, grow)  # a place in the batch (FIFO queue beyond serve --max-batch / --max-kv-mb)
        try:
            yield from run_reply(self, turn, replay_from)
        finally:  # ended, failed, paused for a migration or dropped by its client: the place is free
            self.host.steps.leave(self)
            admission.leave(self)

    def guest_step(self, ahead: tuple[int, Any, Any] | None = None, deadline_ms: float | None = None) -> int:
        """One call of the guest's step export: its next token, or a stop code. With
        ``ahead`` (token, logits, top1) the host already ran the decode the guest is expected
        to ask for (the token it returned last): its ``kv_decode`` of that token takes
        those logits; another token, or none, and that step is taken back."""
        budget = self.host.policy.guest_step_ms / 1000
        self._ahead = ahead
        self._prefill_budget, self._decode_budget = self._prompt_left, 1
        try:  # guest code runs outside the compute lock; its model calls take it
            tok = self.guest.call("kvferry_chat_step", deadline_ms=deadline_ms)
        except GuestError as e:
            self.host.metrics.guest_traps.inc()
            log.warning("session %s: %s", self.id, e)
            raise
        finally:
            spent = self.guest.cpu_seconds_over(budget)  # its own CPU time: model work excluded, and the take-back
            self._prefill_budget = self._decode_budget = 0
            if self._ahead is not None:  # the guest did not decode the token run for it
                self._ahead = None
                self._take_back()
        if spent is not None:
            self.host.metrics.guest_traps.inc()
            log.warning("session %s: guest over its step budget (%.1f ms of CPU)", self.id, spent * 1000)
            self.guest.dead = f"spent {spent * 1000:.1f} ms of CPU in a step"
            raise GuestError(f"guest '{self.guest.name}' spent {spent * 1000:.1f} ms of CPU in one step, "
                             f"over this host's budget of {budget * 1000:g} ms (serve --guest-step-ms); "
                             "its session leaves the batch")
        return tok

    @contextlib.contextmanager
    def still(self) -> Iterator[None]:
        """No step of this session runs while the block runs, and none has run past the
        boundary its own thread left it at (kvferry.batching runs steps on): what a
        checkpoint of a session between two steps reads."""
        self.host.steps.settle(self)
        try:
            yield
        finally:
            self.host.steps.release(self)

    def at_length(self, turn: TurnState, n_tokens: int) -> bool:
        """Whether a reply of ``n_tokens`` tokens has reached the host's hard limits (the
        turn's and the session's max tokens, a context without --ctx full): it ends there."""
        limit = min(turn.max_tokens or self.sampling.max_tokens, self.sampling.max_tokens)
        return n_tokens >= limit or (self.options.ctx is None and len(self.history) + 1 >= self.context)

    def will_decode(self, token: int) -> bool:
        """Whether the turn in progress, its guest having just chosen ``token``, asks for
        that token's decode next: a token of the vocabulary, and the reply not at its
        length once it is added (:func:`kvferry.turn.run_reply`)."""
        t = self.turn
        return t is not None and 0 <= token < self.vocab_size and not self.at_length(t, len(t.tokens) + 1)

    def _take_back(self) -> None:
        """Undo the last decoded token (a step the host ran ahead for the guest)."""
        from mlx_lm.models.cache import trim_prompt_cache

        with self.host.compute:  # pre-copy reads the cache and the history under it
            if not self.closed and self.history:
                trim_prompt_cache(self.cache, 1)
                self.history.pop()
                self.kv_epoch += 1  # the token's K/V may have been sent already

    # -- state -----------------------------------------------------------------
    def state(self, memory: bool = True) -> SessionState:
        """This session between two steps (``memory``: with a copy of the guest's)."""
        t = self.turn
        turn = None if t is None else {"n_prompt": t.n_prompt, "record": t.record, "tokens": list(t.tokens),
                                       "texts": list(t.texts), "max_tokens": t.max_tokens}
        return SessionState(self.id, self.sampling, self.options, self.context, list(self.cache),
                            list(self.history), list(self.messages), turn, self.guest.module,
                            self.guest.memory_image() if memory else None, self.kv_epoch, self.owner)

    @classmethod
    def from_state(cls, host: Any, state: SessionState, session_id: str | None = None,
                   guest: Any = None) -> "Session":
        """A session on ``host`` that continues ``state`` (not registered: see
        ModelHost.adopt). The guest gets the saved memory instead of a config call
        (``guest``: an instance made ahead of time, used if it fits)."""
        s = cls(host, state.module, state.sampling, state.options, session_id or state.id, configure=False,
                guest=guest)
        try:
            if state.memory is not None:
                s.guest.load_memory_image(state.memory)
            s.cache = list(state.caches)
            s.history = list(state.history)
            s.messages = list(state.messages)
            s.owner = state.owner
            if state.turn is not None:
                s.restore_turn(**state.turn)
        except BaseException:
            s.close()
            raise
        return s

    # -- reporting ---------------------------------------------------------------
    def plain_kv(self) -> bool:
        """A plain KVCache on every layer (a resident row's too): a step run ahead on it can be taken back."""
        return bool(self.cache) and all(cache_kind(c) == "KVCache" for c in {type(c): c for c in self.cache}.values())

    def memory(self) -> dict:
        kv = sum(c.nbytes for c in self.cache if not c.empty())
        return {"kv_bytes": int(kv), "arena_bytes": int(self.guest.arena.cap) if not self.closed else 0,
                "tokens": len(self.history)}

    def kv_token_bytes(self) -> int:
        """KV bytes one more token adds (keys and values, every layer)."""
        item = 1 if self.options.kv_bits else 2 if self.lm.dtype in ("float16", "bfloat16") else 4
        return 2 * len(self.lm.model.layers) * self.lm.kv_heads * self.lm.head_dim * item

    def describe(self) -> dict:
        return {"id": self.id, "guest": self.guest.module.label, "guest_sha256": self.guest.module.sha256,
                "cache": cache_kind(self.cache[0]), "context": self.context,
                "sampling": asdict(self.sampling), "options": asdict(self.options), **self.memory(),
                "queue_position": self.host.admission.position(self)}

    def close(self) -> None:
        self.host.steps.leave(self)  # a closed session holds no place in the batch, even with
        self.host.admission.leave(self)  # its turn's generator still suspended somewhere
        if not self.closed:
            self.guest.model = None
            self.guest.close()
            self.cache = []
            self.landed_step = None
            self.closed = True
