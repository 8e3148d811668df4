"""Any GenerateRequest the proto can express is either accepted or refused with InvalidInputError
naming a real field path; nothing else escapes validation."""

from __future__ import annotations

import re

from hypothesis import given, settings
from rel_strategies import generate_requests

from mmserve.config import EngineConfig
from mmserve.errors import InvalidInputError
from mmserve.server.validation import validate_request

CONFIG = EngineConfig()
FIELD_PATH = re.compile(r"^(request_id|messages(\[\d+\](\.[a-z_]+(\[\d+\])?)*)?|sampling\.[a-z_]+(\[\d+\])?)$")


@settings(max_examples=100, deadline=None, derandomize=True)
@given(request=generate_requests())
def test_validation_accepts_or_names_the_field(request):
    try:
        validated = validate_request(request, CONFIG)
    except InvalidInputError as e:
        assert FIELD_PATH.match(e.field), e.field
        return
    assert validated.request_id and validated.messages
    assert 0 < validated.sampling.max_tokens <= CONFIG.max_tokens_limit
