"""scrub runs each secret pattern only where the text holds what every match of it holds: the redaction is
the same as running both patterns on every text (the reference below), at a fraction of the cost on the
records watch writes every step (their `"tokens":` key used to run both patterns every time)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ciuic_doctor.machine import envinfo
from ciuic_doctor.machine.envinfo import REDACTED, scrub

PIECES = [
    "--hf-token", "-api_key", "--password", "HF_TOKEN", "API_KEY", "my_secret", "Credential", "tokens",
    "=", " ", '"', '","', ":", "hf_abc123", "s3cr3t!", "1e-05", "-", "--lr", "passwd", "PASSWD", "'", "x",
    '"tokens":null', "AWS_SECRET_ACCESS_KEY", "\n", ",", "@", "https://u:p@host/",
]  # fmt: skip


def reference(text: str) -> str:
    """Both patterns whenever a secret word appears in any case (the rule before the hints)."""
    for value in envinfo._secret_values(envinfo._environ_secrets()):
        if value in text:
            text = text.replace(value, REDACTED)
    upper = text.upper()
    if any(word in upper for word in envinfo.SECRET_NAME_PARTS) or "PASSWD" in upper:
        text = envinfo._SECRET_FLAG.sub(lambda m: f"{m.group('flag')}{m.group('sep')}{REDACTED}", text)
        text = envinfo._SECRET_ASSIGNMENT.sub(envinfo._hide_assignment, text)
    return envinfo.redact_url(text) if "@" in text else text


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.lists(st.sampled_from(PIECES), max_size=14))
def test_hints_redact_what_both_patterns_redact(pieces):
    text = "".join(pieces)
    assert scrub(text) == reference(text)


def test_a_step_record_is_left_as_it_is_and_a_flag_is_still_redacted():
    record = '{"step":3,"loss":2.5,"lr":1e-05,"tokens":null,"optimizer_class":"AdamW"}'
    assert scrub(record) == record
    assert (
        scrub('"argv":["train.py","--hf-token","hf_abc"]') == f'"argv":["train.py","--hf-token","{REDACTED}"]'
    )
    assert scrub("HF_TOKEN=hf_abc") == f"HF_TOKEN={REDACTED}"
