"""Shared by the planner tests."""

import pytest


@pytest.fixture(scope="module", autouse=True)
def _planning_module(frozen_heap):
    """Every module here plans: tests/conftest.py's ``frozen_heap`` for each."""
