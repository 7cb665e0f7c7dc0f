"""connector.vllm.settings: the connector's and the tier's keys parsed once, typed and frozen; unknown keys refused."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from connector.http.client import ClientConfig
from connector.vllm.settings import ConnectorSettings, SettingsError, TierSettings

VLLM_DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"  # its connector tables


def test_defaults_are_the_old_ones() -> None:
    s = ConnectorSettings.parse({})
    cfg = s.client_config()
    assert cfg == ClientConfig(
        base_url="http://127.0.0.1:8750",
        max_connections=32,
        request_timeout_s=30.0,
        lookup_timeout_s=2.0,
        max_inflight_bytes=1024 * 1024 * 1024,
        retries=3,
    )
    assert (s.lookup_wait_ms, s.load_wait_ms, s.load, s.store) == (20.0, 20.0, True, True)
    assert (s.blocks_per_batch, s.store_buffers, s.load_buffers) == (16, 8, 4)


def test_values_are_typed_once() -> None:
    s = ConnectorSettings.parse(
        {"url": "http://gw:1", "timeout_s": 5, "retries": "2", "load": False, "max_inflight_mib": 1, "ca_file": None}
    )
    assert s.timeout_s == 5.0 and isinstance(s.timeout_s, float)
    assert s.retries == 2 and s.load is False and s.ca_file is None
    assert s.client_config().max_inflight_bytes == 1024 * 1024
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.retries = 9  # type: ignore[misc]


@pytest.mark.parametrize("settings", [ConnectorSettings, TierSettings])
def test_a_misspelt_key_fails_naming_it_and_the_known_ones(settings: type[ConnectorSettings]) -> None:
    with pytest.raises(SettingsError) as err:
        settings.parse({"url": "http://gw:1", "retires": 3})
    message = str(err.value)
    assert "'retires'" in message
    assert all(k in message for k in settings.known_keys())


@pytest.mark.parametrize(
    ("key", "value"),
    [("retries", "three"), ("retries", 2.5), ("retries", True), ("load", "false"), ("timeout_s", [1]), ("url", 7)],
)
def test_a_value_of_the_wrong_type_fails(key: str, value: object) -> None:
    with pytest.raises(SettingsError, match=key):
        ConnectorSettings.parse({key: value})


def test_the_tier_needs_its_url_and_keeps_its_defaults() -> None:
    with pytest.raises(SettingsError, match="url"):
        TierSettings.parse({})
    t = TierSettings.parse({"url": "http://gw:1/", "max_inflight_bytes": 4096, "locality": "rack1"})
    cfg = t.client_config()
    assert cfg.base_url == "http://gw:1" and cfg.max_inflight_bytes == 4096
    assert (cfg.connect_timeout_s, cfg.lookup_timeout_s, cfg.request_timeout_s) == (0.5, 0.5, 30.0)
    assert (cfg.retries, cfg.down_cooldown_s, t.lookup_batch_keys, t.enable_kv_events) == (1, 2.0, 4096, False)


@pytest.mark.parametrize("settings", [ConnectorSettings, TierSettings])
def test_every_key_is_in_the_vllm_doc(settings: type[ConnectorSettings]) -> None:
    text = VLLM_DOC.read_text()
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", text, re.MULTILINE))
    missing = set(settings.known_keys()) - documented
    assert not missing, f"docs/vllm.md's connector tables lack {sorted(missing)}"
