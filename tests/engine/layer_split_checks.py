"""Checks of a layer split shared by the emulated runtime's tests (test_layer_split_host.py) and the
device's (test_layer_split_gpu.py): the split's runner against one card's, bit for bit."""
import numpy as np

ORDERS = ([0, 1, 2], [2, 0], [1], [0, 2, 1], [2, 0], [1, 2], [0, 1, 2])


def same_parallel_slots(one, two, rng, lengths=(20, 9, 30), orders=ORDERS) -> None:
    """Prompts of these lengths in slots 0.., then batched steps of the slots in each order (each row
    count eager, captured and replayed): every slot's logits on the split's last card equal one
    card's, and the split's tokens are each card's."""
    V = one.args.vocab_size
    for slot, n in enumerate(lengths):
        ids = rng.integers(0, V, n).tolist()
        for r in (one, two):
            r.use(slot)
            r.prefill(ids, 0, logits=False)
    for order in orders:
        toks = rng.integers(0, V, len(order)).tolist()
        one.decode_batch(order, toks)
        two.decode_batch(order, toks)
        for slot in order:
            one.use(slot)
            two.use(slot)
            np.testing.assert_array_equal(two.last.ops.to_host(two.last._last), one.ops.to_host(one._last))
            assert two.cached_ids == one.cached_ids == two.stages[0].cached_ids
