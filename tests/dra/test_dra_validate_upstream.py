"""devplug's mirror of the API server's ResourceSlice validation against the API server's own
test cases (tests/dra/upstream_slice_cases.py, transcribed from kubernetes/kubernetes): every
slice upstream accepts is accepted, every one it refuses is refused with the same errors, by
field path and reason. The stand-in API server validates with the mirror, so its tests cannot
catch a mistake in it; these can."""

from __future__ import annotations

import pytest
from upstream_slice_cases import CREATE_CASES, UPDATE_CASES, Case, Errors, UpdateCase

from devplug.dra.field_errors import FieldError
from devplug.dra.validate import validate_resource_slice, validate_resource_slice_update


def found(errors: list[FieldError]) -> Errors:
    return sorted((error.field, error.reason) for error in errors)


@pytest.mark.parametrize("case", CREATE_CASES, ids=[case.name for case in CREATE_CASES])
def test_a_new_slice_is_judged_as_the_api_server_judges_it(case: Case) -> None:
    assert found(validate_resource_slice(case.slice)) == sorted(case.errors)


@pytest.mark.parametrize("case", UPDATE_CASES, ids=[case.name for case in UPDATE_CASES])
def test_an_update_is_judged_as_the_api_server_judges_it(case: UpdateCase) -> None:
    assert found(validate_resource_slice_update(case.new, case.old)) == sorted(case.errors)


def test_the_table_is_the_one_transcribed() -> None:
    # A case dropped from the table by mistake would pass unnoticed.
    assert len(CREATE_CASES) == 56 and len(UPDATE_CASES) == 5
    assert len({case.name for case in CREATE_CASES}) == len(CREATE_CASES)
