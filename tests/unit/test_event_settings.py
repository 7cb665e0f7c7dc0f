"""The events' settings: defaults every router we name indexes (tests/events/test_dynamo.py runs Dynamo's), and an
address pair per model only where the topic tells the models apart."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.config import Settings

PAIR = {"org/m": ("tcp://127.0.0.1:5561", "tcp://127.0.0.1:5562")}


def test_defaults_leave_locality_and_ownership_unset() -> None:
    s = Settings()
    assert (s.events_medium, s.events_locality, s.events_ownership) == ("STORAGE", "", "")


@pytest.mark.parametrize("topic", ["kv@pool:{name}", "kv@{namespace}@{model}"])
def test_model_endpoints_need_one_topic_per_model(topic: str) -> None:
    with pytest.raises(ValidationError, match="events_model_endpoints"):
        Settings(events_model_endpoints=PAIR, events_topic=topic)
    assert Settings(events_model_endpoints=PAIR).events_model_endpoints == PAIR
