"""A call on a thread of its own, its outcome kept for the test to assert on (the tests that race a call against
a stage loss or a recovery)."""
import threading


def start(fn, *args) -> tuple[threading.Thread, dict]:
    """Run fn(*args) on a daemon thread now. Returns (the thread, out): once the thread is joined, out["r"] is what
    fn returned or the exception it raised."""
    out = {}

    def run():
        try:
            out["r"] = fn(*args)
        except Exception as e:  # noqa: BLE001 - the outcome is the test's to judge
            out["r"] = e
    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, out
