"""harness/benchdoc.py: the benchmarks' shared comma-list parser names the flag it refuses."""

import pytest

from specbench.harness.benchdoc import positive_ints


def test_positive_ints_parses_comma_lists():
    assert positive_ints("1,8,16") == (1, 8, 16)
    assert positive_ints(" 32 , 64 ,") == (32, 64)


@pytest.mark.parametrize("text", ["", ",", "1,x", "0,8", "-1", "1.5"])
def test_positive_ints_refuses_naming_the_flag(text):
    with pytest.raises(SystemExit) as e:
        positive_ints(text, "--levels")
    assert "--levels" in str(e.value) and "integers >= 1" in str(e.value)
