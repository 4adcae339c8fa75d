"""Flushing at process exit, however the process ends.

* normal exit, ``sys.exit`` and an uncaught exception: an ``atexit`` hook;
* ``multiprocessing`` workers (fork or spawn) leave through ``os._exit`` after running
  ``multiprocessing.util`` finalizers, not ``atexit``: a finalizer is registered too;
* ``SIGTERM`` (a scheduler or ``Pool.terminate`` stopping the job): when no handler of the
  user's is installed, ours flushes within the deadline and then lets the default action kill
  the process, so the exit status is still "killed by SIGTERM";
* ``SIGINT``: Python raises ``KeyboardInterrupt``, which unwinds ``with otr.episode`` blocks
  (those episodes are marked ``truncated``) and ends in the ``atexit`` hook.

The flush at a signal runs on a helper thread joined with a deadline: the signal may have
interrupted the main thread inside one of the library's locks, and waiting on it must not hang
the exit. Only the process that configured a runtime flushes it: a forked child that inherited
its parent's (with the parent's export threads gone) discards it.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
from collections.abc import Callable

logger = logging.getLogger("otel_rollouts")

_installed_pid: int | None = None
_signals_installed: set[int] = set()
_flush: Callable[[float], object] | None = None
_timeout = 10.0


def install(flush: Callable[[float], object], timeout: float, handle_signals: bool = True) -> None:
    """Make ``flush(timeout)`` run at every kind of exit of this process (idempotent)."""
    global _installed_pid, _flush, _timeout
    _flush, _timeout = flush, timeout
    pid = os.getpid()
    if _installed_pid != pid:
        _installed_pid = pid
        atexit.register(_at_exit)
        try:
            from multiprocessing import util

            util.Finalize(None, _at_exit, exitpriority=100)
        except Exception:  # noqa: BLE001 - not fatal: atexit still covers the main process
            pass
        _signals_installed.clear()
    if handle_signals:
        _install_signal(signal.SIGTERM)


def _install_signal(signum: int) -> None:
    if signum in _signals_installed or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signum) is not signal.SIG_DFL:
            return  # the user's own handler (or SIG_IGN) decides; atexit still flushes
        signal.signal(signum, _on_signal)
        _signals_installed.add(signum)
    except (ValueError, OSError):  # not the main interpreter, or an unsupported signal
        pass


def _at_exit() -> None:
    if _installed_pid != os.getpid() or _flush is None:
        return
    try:
        _flush(_timeout)
    except Exception:  # noqa: BLE001 - exiting: nothing may be raised from here
        pass


def _on_signal(signum: int, frame: object) -> None:
    worker = threading.Thread(target=_at_exit, name="otel-rollouts-exit-flush", daemon=True)
    worker.start()
    worker.join(_timeout + 1.0)
    if worker.is_alive():
        logger.warning("otel_rollouts: flush at signal %d did not finish within %.0f s", signum, _timeout)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
