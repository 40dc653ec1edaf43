"""Calls from several threads at once, for the tests of the shared request queue."""
import threading


def in_threads(fn, items, timeout_s: float = 120.0) -> tuple[dict, list]:
    """fn(item) for each item, each on its own thread, all started together -> ({item: result},
    [the exceptions raised])."""
    got, errors = {}, []

    def call(item):
        try:
            got[item] = fn(item)
        except Exception as e:      # noqa: BLE001 - the caller asserts there were none
            errors.append(e)
    threads = [threading.Thread(target=call, args=(item,)) for item in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return got, errors
