"""``s3://bucket/prefix`` as the CLI takes it."""

from __future__ import annotations

from typing import NamedTuple

from cachefs.commands import check_repo_target
from cachefs.errors import InvalidArgument


class S3Url(NamedTuple):
    bucket: str
    prefix: str  # "" or ending in "/": a link shows a "directory" of the bucket

    @classmethod
    def parse(cls, text: str) -> S3Url:
        scheme, sep, rest = text.partition("://")
        if scheme != "s3" or not sep:
            raise InvalidArgument(f"repository must be s3://BUCKET[/PREFIX], got {text!r}")
        bucket, _, prefix = rest.partition("/")
        prefix = prefix.strip("/")
        prefix = prefix + "/" if prefix else ""
        check_repo_target(bucket, prefix, "", "")
        return cls(bucket, prefix)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"
