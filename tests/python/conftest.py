"""Shared by the Python tests: a bound on one blocking wait.

pika's BlockingConnection bounds a socket read (socket_timeout) but not a synchronous RPC: a
reply the broker never sends (a channel.close-ok, say) waits forever. `within` bounds such a
wait and names it. pytest-timeout (scripts/test.sh runs it with --timeout 60, signal method)
uses the same SIGALRM timer: `within` takes the timer over and gives it back with the time
that was left, so both bounds hold.
"""
import contextlib
import signal
import time


@contextlib.contextmanager
def within(what, seconds=15):
    """Raises TimeoutError naming `what` if the block takes longer than `seconds`."""

    def expired(_signum, _frame):
        raise TimeoutError(f"no {what} within {seconds} s")

    handler = signal.signal(signal.SIGALRM, expired)
    outer, interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, handler)
        if outer:
            # The outer bound (pytest-timeout's) with what it had left; at least a moment so
            # that an outer bound already due still fires.
            left = max(outer - (time.monotonic() - start), 0.001)
            signal.setitimer(signal.ITIMER_REAL, left, interval)
