"""Pipeline calls: when one ``pipe(...)`` of a diffusers pipeline starts and ends, seen without
changing a class.

    calls = pipeline_calls(pipe)                 # residency.adapters.diffusers, while offloaded
    calls.on_end(lambda end: print(end.number, end.how.value))   # on_start(print): the number
    pipe(prompt)                                 # prints "1 returned"
    calls.started, calls.ended, calls.in_call    # (1, 1, False)

`enable_offload` makes the pipeline's `PipelineCalls` and sets its two `CallBoundary` wrappers on
the pipeline instance, and marks each call on the scheduler (`Scheduler.call`: a call's bytes and
seconds in ``scheduler.calls``, what an auto plan learns from); `disable_offload` takes them off.
`check_not_in_call` is the refusal both run first: neither acts while a call of that pipeline
is on any thread's stack.

[Note: pipeline calls]
A call is one ``pipe(...)``: from its start until it returns or raises.  Its ``__call__`` cannot
be wrapped per instance (``pipe(...)`` looks the method up on the class), so the adapter sees a
call two ways, neither of which changes a class:

* Whether one runs now (`PipelineCalls.in_call`; the refusals of `disable_offload` and
  `enable_offload`) is read off the threads' stacks: a frame running a ``__call__`` of the
  pipeline's class (each one in its MRO, under ``torch.no_grad``'s functools.wraps) whose
  ``self`` is this pipeline.  Exact at every instant, however the call ends - an exception from
  a component's forward, from a callback, from the VAE, a KeyboardInterrupt anywhere - and for
  every pipeline, offloaded or not.  The frame is read when asked, never kept: a kept frame would
  keep a raised call's tensors alive, and a frame's address is reused by the next call, so it
  cannot name a call either.  (Reading a running frame's ``self`` leaves a snapshot of its locals
  on it until its next read or its end, before Python 3.13; only the pipeline's own ``__call__``
  frames are read.)
* Its boundaries (`PipelineCalls.started`, `ended`, `on_end`) are the two steps every diffusers
  call runs on the pipeline instance first and last, each wrapped by a `CallBoundary`:
  ``check_inputs`` starts a call, ``maybe_free_model_hooks`` ends it, each counted only when
  called from the pipeline's own ``__call__``.  Diffusers 0.42 exports 277 pipelines: 235 call
  ``check_inputs`` from ``__call__`` and 269 ``maybe_free_model_hooks``.  The other 42 (the
  Kandinsky and Kandinsky 2.2 family, ZImage, Amused, Shap-E, UnCLIP, DDPM, ...) start no count:
  their calls are refused against all the same, but not counted.  A ``check_inputs`` that raises
  ends its call at once (`Ending.RAISED`).  A call that raises anywhere else, or returns without
  ``maybe_free_model_hooks`` (8 pipelines lack it; 14 can return before it, e.g. SDXL's
  inpainting for ``output_type="latent"``), is found ended (`Ending.FOUND`) the next time the
  adapter looks: at the next call's start, at `disable_offload`, or when `ended` or `in_call` is
  read.  An exception leaving a `PhaseEntry` does not end a call: the pipeline may catch it, and
  a callback's exception passes through no entry.
* One call at a time: diffusers keeps a call's state on the pipeline (``_guidance_scale``,
  ``_num_timesteps``, ``_interrupt``), so concurrent calls of one pipeline are not supported by
  diffusers either; a second start while one is counted ends the first as `Ending.FOUND`.
* Refused, not deferred.  A `disable_offload` deferred to the call's end would need that end at
  the instant it happens, which only wrapping ``__call__`` gives (a raised call is seen late),
  and it would act later than the line that asked for it; a refusal acts where it is asked, and
  its `PhaseError` names the fix: disable after the call returns, or end the call early with
  ``pipe._interrupt = True`` from the callback.  Uncaught, it ends the call like any error from
  a callback; caught, the call goes on offloaded.
"""

from __future__ import annotations

import enum
import functools
import inspect
import sys
import threading
import weakref
from collections.abc import Callable
from types import FrameType

import attrs

from residency.core.errors import PhaseError
from residency.modules.instance_wrappers import InstanceWrapper, chain

__all__ = [
    "CALL_END",
    "CALL_START",
    "CallBoundary",
    "CallEnd",
    "Ending",
    "PipelineCalls",
    "check_not_in_call",
    "remove_boundaries",
    "set_boundaries",
]

#: The pipeline method a diffusers call runs first, where a `CallBoundary` starts the call's count.
CALL_START = "check_inputs"
#: The pipeline method a diffusers call runs last, where a `CallBoundary` ends it.
CALL_END = "maybe_free_model_hooks"



class Ending(enum.Enum):
    """How the adapter saw a pipeline call end (`CallEnd.how`)."""

    #: Its last step, ``maybe_free_model_hooks``, returned inside the call: the end is exact.
    RETURNED = "returned"
    #: A boundary step raised (``check_inputs`` refused the inputs), and the call with it: exact.
    RAISED = "raised"
    #: Found ended afterwards: it raised elsewhere or returned without its last step; found at
    #: the next call's start, at `disable_offload`, or when `PipelineCalls.ended` or
    #: `PipelineCalls.in_call` was read.  When it ended is not known.
    FOUND = "found"


@attrs.frozen
class CallEnd:
    """One pipeline call's end, as `PipelineCalls` tells its listeners.

        calls.on_end(lambda end: print(f"call {end.number}: {end.how.value}"))
        pipe(prompt)                             # prints "call 1: returned"
    """

    #: Which call: 1 for the first one started after `enable_offload`.
    number: int
    #: How the adapter saw it end.
    how: Ending


@attrs.frozen
class _Count:
    """The calls started and ended so far: `PipelineCalls` replaces it whole, in one assignment,
    so an interrupt leaves the old count or the new one."""

    started: int = 0
    ended: int = 0


class PipelineCalls:
    """The calls of one offloaded pipeline: how many started and ended, and whether one runs now.

        calls = pipeline_calls(pipe)
        calls.on_end(print)           # CallEnd(number=1, how=<Ending.RETURNED: 'returned'>)
        pipe(prompt)
        calls.started, calls.ended    # (1, 1)
        calls.in_call                 # False here; True inside the call (in a callback)

    Rules (see [Note: pipeline calls]):

    * `in_call` is exact at every instant: a ``__call__`` of the pipeline is on a thread's stack.
      It is True from ``pipe(...)`` until the call returns or raises, also before ``check_inputs``
      and after ``maybe_free_model_hooks``, and for pipelines whose calls are not counted.
    * `started` counts the calls whose ``check_inputs`` ran; `ended` those seen ending, a call
      that raised included once it is found (reading `ended` looks).  ``started - ended`` is 1
      while a counted call runs, else 0: one call at a time.
    * Each listener added with `on_end` is told each end once, in the order added, on the thread
      that saw it, after the count changed; an exception from a listener goes to that thread (the
      pipeline call, or whoever looked) and the listeners after it are not told.

    Made by `enable_offload`; dropped by `disable_offload`, listeners included.  A pipeline whose
    ``__call__`` runs no ``check_inputs`` (Kandinsky's, ZImage's, ...) counts nothing, and
    `in_call` still holds.
    """

    __slots__ = ("_pipeline", "_codes", "_lock", "_count", "_listeners", "_starters")

    def __init__(self, pipe: object) -> None:
        #: The pipeline, weakly: the record that holds this must not keep it alive.
        self._pipeline = weakref.ref(pipe)
        #: The code each ``__call__`` in the pipeline class's MRO runs (`_call_codes`).
        self._codes = _call_codes(type(pipe))
        #: Guards `_count` and `_listeners`: the pipeline's thread starts and ends calls, any
        #: thread may find a call ended or add a listener.
        self._lock = threading.Lock()
        #: The calls started and ended; replaced whole, under `_lock`.
        self._count = _Count()
        #: Told of each end, in order; replaced whole, under `_lock`.
        self._listeners: tuple[Callable[[CallEnd], object], ...] = ()
        #: Told of each start (its number), in order; replaced whole, under `_lock`.
        self._starters: tuple[Callable[[int], object], ...] = ()

    @property
    def started(self) -> int:
        """How many calls have started (run ``check_inputs``) since `enable_offload`."""
        return self._count.started

    @property
    def ended(self) -> int:
        """How many of them have ended; a call that raised counts once found (this looks)."""
        self.refresh()
        return self._count.ended

    @property
    def in_call(self) -> bool:
        """Whether a call of the pipeline runs now, on any thread (this looks, as `refresh`)."""
        return self.refresh()

    def on_end(self, listener: Callable[[CallEnd], object]) -> None:
        """Tell `listener` of each call's end from now on: ``listener(CallEnd(...))``."""
        with self._lock:
            self._listeners = (*self._listeners, listener)

    def on_start(self, listener: Callable[[int], object]) -> None:
        """Tell `listener` of each call's start from now on: ``listener(number)``, after the
        call before, if it was not seen ending, was told ended (`Ending.FOUND`)."""
        with self._lock:
            self._starters = (*self._starters, listener)

    def refresh(self) -> bool:
        """End a counted call that no longer runs (`Ending.FOUND`); whether a call runs now."""
        seen = self._count
        pipe = self._pipeline()
        if pipe is not None and _call_running(pipe, self._codes):
            return True
        if seen.started > seen.ended:
            self._end(Ending.FOUND, unless_changed_from=seen)
        return False

    def begin(self, caller: FrameType) -> bool:
        """Start a call when `caller` (the frame that ran ``check_inputs``) is the pipeline's
        ``__call__``; one counted and not seen ending is found ended first.  Whether it started."""
        if caller.f_code not in self._codes:
            return False
        with self._lock:
            count = self._count
            self._count = _Count(started=count.started + 1, ended=count.started)
            listeners, starters = self._listeners, self._starters
        if count.started > count.ended:
            _tell(listeners, CallEnd(count.started, Ending.FOUND))
        _tell(starters, count.started + 1)
        return True

    def finish(self, how: Ending, caller: FrameType) -> None:
        """End the counted call, if one runs and `caller` is the pipeline's ``__call__``."""
        if caller.f_code in self._codes:
            self._end(how, unless_changed_from=None)

    def _end(self, how: Ending, unless_changed_from: _Count | None) -> None:
        with self._lock:
            count = self._count
            changed = unless_changed_from is not None and unless_changed_from is not count
            if count.started == count.ended or changed:
                return  # nothing runs, or the count changed since the caller looked
            self._count = _Count(started=count.started, ended=count.started)
            listeners = self._listeners
        _tell(listeners, CallEnd(count.started, how))

    def __repr__(self) -> str:
        pipe = self._pipeline()
        owner = "a dropped pipeline" if pipe is None else type(pipe).__name__
        count = self._count
        return f"<PipelineCalls of {owner}: {count.started} started, {count.ended} ended>"


def _tell(listeners: tuple[Callable, ...], what: CallEnd | int) -> None:
    for listener in listeners:
        listener(what)


def _call_codes(pipeline_class: type) -> frozenset:
    """The code objects a call of `pipeline_class` runs as ``__call__``: each class's own in the
    MRO (a subclass's ``super().__call__``), under its decorators (``torch.no_grad`` keeps
    ``__wrapped__``)."""
    codes = set()
    for klass in pipeline_class.__mro__:
        method = vars(klass).get("__call__")
        code = getattr(inspect.unwrap(method), "__code__", None) if callable(method) else None
        if code is not None:
            codes.add(code)
    return frozenset(codes)


def _call_running(pipe: object, codes: frozenset) -> bool:
    """Whether a frame of some thread runs one of `codes` with ``self`` being `pipe`.

    Frames are read, never kept (see [Note: pipeline calls]); the current thread's own frame is
    among them, so the mapping is dropped before returning (it would hold itself).
    """
    frames = sys._current_frames()
    try:
        return any(_runs_a_call(top, pipe, codes) for top in frames.values())
    finally:
        del frames


def _runs_a_call(frame: FrameType | None, pipe: object, codes: frozenset) -> bool:
    while frame is not None:
        if frame.f_code in codes and frame.f_locals.get("self") is pipe:
            return True
        frame = frame.f_back
    return False


def check_not_in_call(pipe: object, verb: str) -> None:
    """Refuse `verb` ("enable" or "disable") during a call of `pipe` ([Note: pipeline calls])."""
    if not _call_running(pipe, _call_codes(type(pipe))):
        return
    owner = type(pipe).__name__
    why = {"disable": "the rest of the call needs its components where offloading keeps them",
           "enable": "the call has already placed its inputs for the components as they are"}
    raise PhaseError(
        f"cannot {verb} offloading on this {owner} during one of its calls: {verb}_offload was "
        "called while pipe(...) runs (from a callback such as callback_on_step_end, or from "
        f"another thread), and {why[verb]}. Call {verb}_offload(pipe) after pipe(...) returns; "
        "to end the call early from callback_on_step_end, set pipe._interrupt = True there"
    )


class CallBoundary(InstanceWrapper):
    """The pipeline's own ``check_inputs`` or ``maybe_free_model_hooks``, telling its
    `PipelineCalls` that a call starts or ends (see [Note: pipeline calls]).

        pipe.check_inputs            # <CallBoundary 'check_inputs': starts a call>
        pipe(prompt)                 # check_inputs: calls.begin(); maybe_free_model_hooks: finish

    `enable_offload` sets both on the pipeline instance, over what a call ran before (the class's
    method, or another per-instance wrapper); `disable_offload` takes them off as `PhaseEntry`
    objects are taken off components (see [Note: other wrappers] in diffusers.py).  Counted only
    when the caller is the pipeline's ``__call__``: a direct ``pipe.check_inputs(...)`` passes
    through.  A sibling pipeline built from the same components has none: they live on this
    instance.
    Setting, removing, detaching and copying are `InstanceWrapper`'s (`attached` is the
    `PipelineCalls`).
    """

    __slots__ = ("__dict__",)

    def __init__(self, calls: PipelineCalls, pipe: object, name: str) -> None:
        super().__init__(pipe, name, calls)
        functools.update_wrapper(self, self.__wrapped__)  # its name, docstring and signature
        self.__dict__.pop("__wrapped__", None)  # a copied one, hidden by the slot

    def __call__(self, *args, **kwargs):
        calls = self.attached
        if calls is None:
            return self.__wrapped__(*args, **kwargs)
        caller = sys._getframe(1)
        counted = self.name != CALL_START or calls.begin(caller)
        try:
            result = self.__wrapped__(*args, **kwargs)
        except BaseException:
            if counted:
                calls.finish(Ending.RAISED, caller)
            raise
        if self.name == CALL_END:
            calls.finish(Ending.RETURNED, caller)
        return result

    def __repr__(self) -> str:
        if self.attached is None:
            return f"<CallBoundary {self.name!r}, detached>"
        edge = "starts" if self.name == CALL_START else "ends"
        return f"<CallBoundary {self.name!r}: {edge} a call>"


def set_boundaries(calls: PipelineCalls, pipe: object) -> None:
    """Set a `CallBoundary` for each of `CALL_START`, `CALL_END` that `pipe` has."""
    for name in (CALL_START, CALL_END):
        if callable(getattr(pipe, name, None)):
            CallBoundary(calls, pipe, name).install()


def remove_boundaries(calls: PipelineCalls, pipe: object) -> None:
    """Take `calls`' boundaries off `pipe`: outermost ones replaced by what they wrapped, buried
    ones detached (repeatable)."""
    for name in (CALL_START, CALL_END):
        for link in chain(vars(pipe).get(name)):
            if isinstance(link, CallBoundary) and link.attached is calls:
                link.remove()
