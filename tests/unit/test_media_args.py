"""serve's image flags -> MediaPolicy; bad values are one-line ValueErrors (the CLI's exit 2)."""
from __future__ import annotations

import argparse

import pytest

from deepinfer.multimodal.media_args import (add_media_args, media_policy_from_args,
                                             parse_limit_mm_per_prompt)


def policy(*argv):
    parser = argparse.ArgumentParser()
    add_media_args(parser)
    return media_policy_from_args(parser.parse_args(list(argv)))


@pytest.mark.parametrize("text,expected", [
    ('{"image": 2}', 2), ("image=3", 3), (" image = 0 ", 0), ("{}", 4), (None, 4)])
def test_limit_mm_per_prompt_shapes(text, expected):
    assert parse_limit_mm_per_prompt(text) == expected


@pytest.mark.parametrize("text,words", [
    ('{"image": 2', "not valid JSON"), ("[2]", "must be an object"), ("image", "expects image=N"),
    ('{"video": 1}', "unsupported modality video"), ("image=two", "whole number"),
    ('{"image": 1.5}', "whole number"), ("image=-1", ">= 0"), ('{"image": true}', "whole number")])
def test_limit_mm_per_prompt_refuses_nonsense(text, words):
    with pytest.raises(ValueError, match=words):
        parse_limit_mm_per_prompt(text)


def test_policy_from_flags(tmp_path):
    p = policy("--limit-mm-per-prompt", '{"image": 2}', "--allowed-local-media-path", str(tmp_path),
               "--allowed-media-domains", "Images.example.com", "cdn.example.com,x.example.org",
               "--max-image-pixels", "1000")
    assert p.limit_per_prompt == 2 and p.max_pixels == 1000
    assert p.allowed_local_media_path == str(tmp_path)
    assert p.allowed_media_domains == ("images.example.com", "cdn.example.com", "x.example.org")
    default = policy()
    assert default.allowed_media_domains == () and default.allowed_local_media_path is None


def test_policy_flags_refuse_bad_values(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        policy("--allowed-local-media-path", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="host names"):
        policy("--allowed-media-domains", "https://example.com")
    with pytest.raises(ValueError, match="--max-image-pixels"):
        policy("--max-image-pixels", "0")


def test_fetch_flags():
    p = policy("--allow-private-media", "--media-fetch-timeout", "2.5", "--max-media-redirects", "0")
    assert p.allow_private_media and p.media_fetch_timeout_s == 2.5 and p.max_media_redirects == 0
    default = policy()
    assert not default.allow_private_media and default.max_media_redirects == 3
    with pytest.raises(ValueError, match="--media-fetch-timeout"):
        policy("--media-fetch-timeout", "0")
    with pytest.raises(ValueError, match="--max-media-redirects"):
        policy("--max-media-redirects", "-1")
