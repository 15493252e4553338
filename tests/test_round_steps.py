"""The server's round as arrays (`ServerRole.round_steps`) follows the inbox it was built from, item by item."""

from test_pooled_aggregation import _round

from zofed.fl.aggregate import clip_update


def test_the_rounds_arrays_see_an_inbox_changed_in_place():
    """Clipping and screening replace the accepted uplinks in the same list (`inbox.accepted[:] = ...`): the
    arrays built before must not be handed out again for the changed round."""
    server, (local, inbox) = _round(shared=True)
    steps = server.round_steps(inbox.accepted, server._sent)
    assert server.round_steps(inbox.accepted, server._sent) is steps  # the pooled mean and observe share them
    inbox.accepted[:] = [clip_update(u, 1e-3)[0] for u in inbox.accepted]  # same list, same length, new uplinks
    clipped = server.round_steps(inbox.accepted, server._sent)
    assert clipped is not steps
    assert abs(clipped.grads).max() < abs(steps.grads).max()
    for u, row in zip(inbox.accepted, clipped.grads, strict=True):
        assert (row == u.grads).all()
    inbox.accepted[:] = inbox.accepted[::-1]  # the same uplinks in another order: another round of arrays
    assert server.round_steps(inbox.accepted, server._sent).client_ids.tolist() == [
        u.client_id for u in inbox.accepted]
    server._sent[inbox.accepted[0].client_id] = server._sent[inbox.accepted[0].client_id].copy()  # a new state
    again = server.round_steps(inbox.accepted, server._sent)
    assert again.states[0] is server._sent[inbox.accepted[0].client_id]
