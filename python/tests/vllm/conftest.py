"""The vLLM plugin's tests run in .venv-vllm (scripts/vllm-test.sh), never in .venv: every test here
is marked slow (vLLM engines start in each)."""
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts vLLM engines (scripts/vllm-test.sh)")


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.slow)
