"""schemas/acked.py's settings: the re-send timeouts must fit the stream's duplicate window.
(On a real nats-server: tests/integration/test_acked.py.)"""

from __future__ import annotations

import pytest

from schemas.acked import AckedPublisher


def test_the_timeouts_must_fit_the_duplicate_window():
    with pytest.raises(ValueError, match="duplicate window"):
        AckedPublisher(None, "x", ack_timeout_s=2, give_up_s=300)
    with pytest.raises(ValueError):
        AckedPublisher(None, "x", ack_timeout_s=5, give_up_s=2)
