"""Flushing at process exit, however the process ends.

* normal exit, ``sys.exit`` and an uncaught exception: an ``atexit`` hook;
* ``multiprocessing`` workers (fork or spawn) leave through ``os._exit`` after running
  ``multiprocessing.util`` finalizers, not ``atexit``: a finalizer is registered too;
* ``SIGTERM`` (a scheduler or ``Pool.terminate`` stopping the job): when no handler of the
  user's is installed, ours flushes within the deadline and then lets the default action kill
  the process, so the exit status is still "killed by SIGTERM";
* ``SIGINT``: Python raises ``KeyboardInterrupt``, which unwinds ``with otr.episode`` blocks
  (those episodes are marked ``truncated``) and ends in the ``atexit`` hook.

A signal handler runs on the main thread between two bytecodes, possibly in the middle of one
of the library's own calls (``end_step``, ``flush``, ``configure``, recording an episode) that
holds a lock the flush needs. The flush therefore never runs under the interrupted call:

* if the main thread was in user code (the usual case), the flush runs on a helper thread while
  the main thread waits in the handler, at most ``exit_timeout``;
* if it was inside the library, the handler only starts the helper and returns, so that the
  interrupted call finishes and releases its locks; the helper waits for the main thread to
  leave the library (at most half the deadline), then flushes what is decided by then, taking
  every lock with a deadline, and ends the process with the signal.

A Python-level handler only runs when the main thread executes bytecode. A main thread blocked
in a long C call that releases the GIL (a collective, a device sync, ``os.system``), or a signal
landing between the interpreter's last check and a blocking call, would leave the handler
unrun for as long as the call lasts: installing our handler must not turn "SIGTERM kills the
job" into "SIGTERM is ignored while the job hangs". The C-level handler writes every signal to
a wakeup fd (when nobody else, e.g. asyncio, owns it); a watcher thread reads it, and when the
Python handler has not claimed the signal within a short grace, the watcher flushes and ends
the process itself (restoring the default action in C, since ``signal.signal`` is main-thread
only).

Either way the process ends within ``exit_timeout`` (plus a second), and a second signal ends
it at once (the default action is restored as soon as the first arrives). Only the process that
configured a runtime flushes it: a forked child that inherited its parent's (with the parent's
export threads gone) discards it.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time
import types
from collections.abc import Callable, Iterable

logger = logging.getLogger("otel_rollouts")

_PACKAGE = __name__.split(".", 1)[0]  # the whole library, whatever folder this module sits in
_POLL_S = 0.005  # how often the helper looks whether the main thread left the library

_WATCH_GRACE_S = 0.25  # how long the watcher leaves the signal to the Python handler


class ExitHooks:
    """This process's exit handling: signal dispositions, the wakeup-fd watcher and atexit hooks
    are per process by nature, so there is exactly one (``hooks()``); the installed ``Rollouts``
    points it at its own flush."""

    def __init__(self) -> None:
        self.installed_pid: int | None = None
        self.signals_installed: set[int] = set()
        self.flush: Callable[[float], object] | None = None
        self.timeout = 10.0
        self.calls_out: set[types.CodeType] = set()  # library frames that run user code, holding no lock
        self.pending: tuple[int, threading.Thread] | None = None  # a signal whose flush is under way
        # the Python handler or the watcher: whichever takes it handles the signal
        self.claim = threading.Lock()
        self.watcher_pid: int | None = None
        self.watch_fds: list[int] = []  # the wakeup pipe (read end, write end) of this process's watcher

    def install(self, flush: Callable[[float], object], timeout: float,
                handle_signals: bool = True) -> None:
        """Make ``flush(timeout)`` run at every kind of exit of this process (idempotent)."""
        install(flush, timeout, handle_signals)

    def uninstall(self, flush: Callable[[float], object]) -> None:
        """``flush`` no longer runs at exit (its instance was shut down); signal handlers stay."""
        if self.flush == flush:
            self.flush = None


_hooks = ExitHooks()


def hooks() -> ExitHooks:
    """The process's exit hooks."""
    return _hooks


def install(flush: Callable[[float], object], timeout: float, handle_signals: bool = True) -> None:
    """Make ``flush(timeout)`` run at every kind of exit of this process (idempotent)."""
    _hooks.flush, _hooks.timeout = flush, timeout
    pid = os.getpid()
    if _hooks.installed_pid != pid:
        _hooks.installed_pid = pid
        atexit.register(_at_exit)
        try:
            from multiprocessing import util

            util.Finalize(None, _at_exit, exitpriority=100)
        except Exception:  # noqa: BLE001 - not fatal: atexit still covers the main process
            pass
        _hooks.signals_installed.clear()
    if handle_signals:
        _install_signal(signal.SIGTERM)


def calls_user_code(functions: Iterable[Callable[..., object]]) -> None:
    """Mark functions (and the functions defined inside them) whose frames only call user code.

    While the main thread is in such a frame it holds none of the library's locks: a signal
    landing in the user code below it may flush at once (``@traced`` wrappers, for instance).
    """
    stack = [fn.__code__ for fn in functions]
    while stack:
        code = stack.pop()
        _hooks.calls_out.add(code)
        stack.extend(const for const in code.co_consts if isinstance(const, types.CodeType))


def inside_library(frame: types.FrameType | None) -> bool:
    """Whether a stack (innermost frame first) is inside a library call that may hold a lock."""
    return library_call(frame) is not None


def library_call(frame: types.FrameType | None) -> types.FrameType | None:
    """The outermost frame of the library call a stack (innermost frame first) is inside, one
    that may hold a lock; None when it is in none. That call has returned, and released what it
    held, once this frame is no longer on the thread's stack."""
    found = None
    while frame is not None:
        if frame.f_code not in _hooks.calls_out:
            module = frame.f_globals.get("__name__")
            if isinstance(module, str) and (module == _PACKAGE or module.startswith(_PACKAGE + ".")):
                if module != __name__:
                    found = frame
        frame = frame.f_back
    return found


def _on_stack(call: types.FrameType, frame: types.FrameType | None) -> bool:
    """Whether ``call`` is still on the stack whose innermost frame is ``frame``."""
    while frame is not None:
        if frame is call:
            return True
        frame = frame.f_back
    return False


def _install_signal(signum: int) -> None:
    if signum in _hooks.signals_installed or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signum) is not signal.SIG_DFL:
            return  # the user's own handler (or SIG_IGN) decides; atexit still flushes
        signal.signal(signum, _on_signal)
        _hooks.signals_installed.add(signum)
    except (ValueError, OSError):  # not the main interpreter, or an unsupported signal
        return
    _start_watcher()


def _start_watcher() -> None:
    """Have the C-level handler report signals on a pipe a watcher thread reads (once per process)."""
    if _hooks.watcher_pid == os.getpid():
        return
    try:
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # the C handler must never block on a full pipe
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except (ValueError, OSError):
        return
    if previous != -1:
        # someone else (an event loop) owns the wakeup fd: leave it to them; the Python handler
        # still works, only a main thread blocked in C goes unnoticed
        signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
        return
    _hooks.watcher_pid = os.getpid()
    _hooks.watch_fds[:] = [read_fd, write_fd]
    threading.Thread(target=_watch, args=(read_fd,), name="otel-rollouts-signal-watch", daemon=True).start()


def _after_fork_in_child() -> None:
    """In a forked child: the parent's signal handling is the parent's.

    * The child stops writing signals into the parent's wakeup pipe: its C handler would
      otherwise report the child's signals (``Pool.terminate`` sends workers SIGTERM) to the
      parent's watcher, which would end the parent.
    * The child gets the default action back for the signals we handle (SIGTERM). Without a
      watcher of its own, the inherited Python-level handler could leave a SIGTERM unrun for as
      long as the child's main thread waits in C (a ``multiprocessing`` worker waiting on its
      queue's lock when ``Pool.terminate`` signals it: the pool's exit then waits forever). The
      child has nothing of its own to flush until it configures (or revives) an instance, and
      that installs the handler again, with a watcher of its own.
    """
    _forget_watcher()
    for signum in _hooks.signals_installed:
        if _handler_is_ours(signum):
            _restore_default(signum)
    _hooks.signals_installed.clear()
    _hooks.pending = None
    _hooks.claim = threading.Lock()  # (the parent's may have been held by a thread gone here)


def _handler_is_ours(signum: int) -> bool:
    try:
        return signal.getsignal(signum) is _on_signal
    except (ValueError, OSError):
        return False


def _restore_default(signum: int) -> None:
    try:
        signal.signal(signum, signal.SIG_DFL)
    except (ValueError, OSError):  # not the main thread here: at the C level then
        _default_action_in_c(signum)


def _forget_watcher() -> None:
    """Stop writing signals into the parent's wakeup pipe (a forked child)."""
    if _hooks.watcher_pid is None:
        return
    _hooks.watcher_pid = None
    read_fd, write_fd = _hooks.watch_fds
    _hooks.watch_fds.clear()
    try:
        # the write end now leads nowhere, whether or not the wakeup fd can be unset here (it
        # stays registered if this thread may not call set_wakeup_fd): never a reused fd number
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, write_fd)
        os.close(devnull)
        os.close(read_fd)
    except OSError:
        pass
    try:
        if signal.set_wakeup_fd(-1) == write_fd:
            os.close(write_fd)
    except (ValueError, OSError):
        pass


def _watch(read_fd: int) -> None:
    try:
        while True:
            data = os.read(read_fd, 64)
            if not data:
                return
            for signum in data:
                if signum in _hooks.signals_installed and _hooks.pending is None and _hooks.watcher_pid == os.getpid():
                    _handle_if_unclaimed(signum)
    except BaseException:  # noqa: BLE001 - a watcher thread never raises into anything
        return


def _handle_if_unclaimed(signum: int) -> None:
    """Handle ``signum`` here if the main thread's Python handler has not within the grace."""
    grace_end = time.monotonic() + _WATCH_GRACE_S
    while time.monotonic() < grace_end:
        if _hooks.pending is not None:
            return  # the Python handler ran
        time.sleep(_POLL_S)  # the handler runs on another thread; there is nothing to wait on
    if not _hooks.claim.acquire(blocking=False):
        return
    if _hooks.installed_pid != os.getpid():
        return
    # the main thread is stuck in C: restore the default action at the C level (a second signal
    # kills at once, and the final os.kill does), then flush with every lock taken on a deadline
    _default_action_in_c(signum)
    _hooks.pending = (signum, threading.current_thread())
    _flush_then_kill(signum, time.monotonic() + _hooks.timeout)


def _default_action_in_c(signum: int) -> None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
        libc.signal(signum, None)  # SIG_DFL is the null handler
    except BaseException:  # noqa: BLE001 - _flush_then_kill falls back to SIGKILL
        pass


def _run_flush(timeout: float) -> None:
    if _hooks.installed_pid != os.getpid() or _hooks.flush is None:
        return
    try:
        _hooks.flush(max(timeout, 0.0))
    except BaseException as exc:  # noqa: BLE001 - exiting: nothing may be raised from here
        if isinstance(exc, KeyboardInterrupt) and threading.current_thread() is threading.main_thread():
            raise


def _at_exit() -> None:
    pending = _hooks.pending
    if pending is not None:
        # a signal's flush is under way on its helper: let it finish, then die of that signal
        signum, helper = pending
        if helper is not threading.current_thread():
            helper.join(_hooks.timeout + 1.0)
            os.kill(os.getpid(), signum)
        return
    _run_flush(_hooks.timeout)


def _on_signal(signum: int, frame: types.FrameType | None) -> None:
    try:
        signal.signal(signum, signal.SIG_DFL)  # a second signal ends the process at once
    except (ValueError, OSError):
        pass
    if _hooks.pending is not None or not _hooks.claim.acquire(blocking=False):
        return  # already flushing for an earlier signal, or the watcher took this one
    deadline = time.monotonic() + _hooks.timeout
    call = library_call(frame)
    if call is None:
        # the training thread stays where it is (in user code, holding none of our locks)
        _hooks.pending = (signum, threading.current_thread())
        _flush_then_kill(signum, deadline)
        return
    # the main thread was interrupted inside the library, maybe holding a lock the flush needs:
    # let it finish that call; the helper flushes once it has, and ends the process
    helper = threading.Thread(
        target=_flush_after_library, args=(signum, deadline, call), name="otel-rollouts-exit", daemon=True
    )
    _hooks.pending = (signum, helper)
    helper.start()


def _flush_after_library(signum: int, deadline: float, call: types.FrameType) -> None:
    """Flush once the interrupted library ``call`` returned (at most half the deadline).

    Waiting for that call, not for the main thread to be seen outside the library: a training
    loop that records episode after episode is inside the library nearly all the time, and an
    exit with nothing left to deliver waited out half of ``exit_timeout`` for a glimpse of it
    outside. Once the interrupted call returned it holds nothing; later calls take locks briefly,
    and the flush takes every lock with a deadline."""
    try:
        main = threading.main_thread()
        wait_until = time.monotonic() + _hooks.timeout / 2
        while time.monotonic() < wait_until and main.is_alive():
            ident = main.ident
            if ident is None or not _on_stack(call, sys._current_frames().get(ident)):
                break
            time.sleep(_POLL_S)  # polling another thread's stack: there is nothing to wait on
    finally:
        del call  # the frame (and what it refers to) is not kept alive by the exit
        _flush_then_kill(signum, deadline)


def _flush_then_kill(signum: int, deadline: float) -> None:
    """Flush on a thread of its own, give it until ``deadline`` (+1 s), then die of ``signum``.

    Nothing here logs or takes a lock: a thread stuck in the flush may hold any of them.
    """
    try:
        flusher = threading.Thread(
            target=_run_flush, args=(deadline - time.monotonic(),), name="otel-rollouts-exit-flush", daemon=True
        )
        flusher.start()
        flusher.join(max(deadline - time.monotonic(), 0.0) + 1.0)
    finally:
        os.kill(os.getpid(), signum)
        # still alive: the default action could not be restored (the watcher's ctypes failed)
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)


# once, at import: a forked child lets go of its parent's signal handling (registered here rather
# than when the handler is installed, so no fork can race with the registration)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
