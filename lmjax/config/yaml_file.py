"""A config file's YAML: one-line errors, and a key given twice in one mapping refused."""

from __future__ import annotations

import os
from collections.abc import Hashable
from typing import Any

import yaml

from lmjax.checks import require
from lmjax.errors import ConfigError, FileFormatError

# The OSErrors of opening a config path: (expected, fix) for each.
_OPEN_ERRORS = {
    FileNotFoundError: ("an existing YAML file", "check the path (see configs/)"),
    IsADirectoryError: ("a YAML file, not a directory", "pass configs/<name>.yaml"),
}


def read_yaml(path) -> Any:
    """A config file's YAML (`{}` when empty), with one-line errors and duplicate keys refused."""
    ok = isinstance(path, str | os.PathLike)  # open(3) would read, then close, descriptor 3
    fix = "pass e.g. 'configs/tiny.yaml'"
    require(ok, "config file", path, "a path (a str or os.PathLike)", fix)
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.load(handle, Loader=_unique_key_loader())
    except (FileNotFoundError, IsADirectoryError) as err:
        expected, fix = _OPEN_ERRORS[type(err)]
        raise ConfigError.describe("config file", str(path), expected, fix) from None
    except ConfigError:
        raise  # a repeated or unhashable key (the loader's own check)
    except (yaml.YAMLError, UnicodeDecodeError, ValueError) as err:
        # ValueError: an int literal over Python's 4,300-digit limit for int(str).
        first = " ".join(str(err).split())
        raise FileFormatError.describe(
            f"config file {path}", f"unparseable YAML ({first})", "valid YAML", "fix the syntax"
        ) from None
    except RecursionError:
        value = "nested deeper than the YAML reader's recursion limit"
        expected = "a config: sections of key: value, a few levels deep"
        error = FileFormatError.describe(
            f"config file {path}", value, expected, "flatten the nesting"
        )
        raise error from None
    return {} if data is None else data


def _unique_key_loader():
    # libyaml's parser (when PyYAML has it) refuses nesting past 1,000 levels at once; the pure
    # Python one takes seconds to reach its recursion limit on such a file.
    class Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
        """SafeLoader that refuses a key given twice in one mapping (YAML keeps the last)."""

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
    return Loader


def _construct_mapping(loader, node, deep=False):
    """A mapping whose keys are hashable and each given once (merged `<<:` entries aside)."""
    seen = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<: *base`: merged entries may be overridden (construct_mapping)
        key = loader.construct_object(key_node, deep=True)  # a list key, filled in
        line = key_node.start_mark.line + 1
        fix = "write a plain key: a list or mapping can't name a field"
        require(isinstance(key, Hashable), "config key", key, f"a string (line {line})", fix)
        expected = f"once per mapping (repeated on line {line})"
        require(key not in seen, "config key", key, expected, "merge the two entries")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)
