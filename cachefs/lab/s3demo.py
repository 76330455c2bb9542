"""The demo bucket of the lab's data repository link (``lab up --s3``, and the compose file's ``s3-demo`` job).

    python -m cachefs.lab.s3demo --endpoint http://s3:8333

Puts ``DEMO_OBJECTS`` JPEG-sized objects in class folders under
``s3://demo/train/`` with the credentials of the environment (the standard
AWS chain), creating the bucket first; running it again puts the same keys.
It also creates the (empty) bucket of the lab's S3-backed volume
``S3_VOLUME``, whose blocks are objects under ``s3://blocks/lab-s3/``
(``cachefs volume create --backing``).
"""

from __future__ import annotations

import argparse
import secrets
from typing import Any

DEMO_BUCKET = "demo"
DEMO_PREFIX = "train/"
DEMO_OBJECTS = 30
S3_VOLUME = "lab-s3"  # the lab's volume whose blocks are objects (volume create --backing)
S3_VOLUME_BUCKET = "blocks"
S3_VOLUME_BACKING = f"s3://{S3_VOLUME_BUCKET}/{S3_VOLUME}/"
# The lab's store has one identity per kind of daemon, each with only what
# docs/deploy.md gives it (SeaweedFS's actions per bucket; its Write covers
# PUT and DELETE alike): mounts write and read lab-s3's blocks and read the
# linked bucket around the cache tier; cache nodes only read; the metanode
# leader lists and deletes lab-s3's blocks (gc) and lists, reads and exports
# the linked bucket. Datanodes get none. The lab itself and its operator's
# CLI use the identity that may do anything.
IDENTITIES = {
    "mount": [f"Read:{S3_VOLUME_BUCKET}", f"Write:{S3_VOLUME_BUCKET}", f"Read:{DEMO_BUCKET}"],
    "cachenode": [f"Read:{S3_VOLUME_BUCKET}", f"Read:{DEMO_BUCKET}"],
    "metanode": [f"Write:{S3_VOLUME_BUCKET}", f"List:{S3_VOLUME_BUCKET}", f"Read:{DEMO_BUCKET}",
                 f"Write:{DEMO_BUCKET}", f"List:{DEMO_BUCKET}"],
}  # fmt: skip


def _create_bucket(client: Any, bucket: str) -> None:
    try:
        client.create_bucket(Bucket=bucket)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass


def fill(client: Any) -> None:
    """Create the demo bucket and the S3-backed volume's (if missing) and put
    the demo's objects, with a boto3 S3 ``client``."""
    _create_bucket(client, DEMO_BUCKET)
    _create_bucket(client, S3_VOLUME_BUCKET)
    for i in range(DEMO_OBJECTS):
        body = secrets.token_bytes(20_000 + 977 * i)
        client.put_object(Bucket=DEMO_BUCKET, Key=f"{DEMO_PREFIX}class{i % 3}/img{i:03d}.jpg", Body=body)


def main(argv: list[str] | None = None) -> None:
    import boto3

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", required=True, help="the S3 endpoint URL, e.g. http://s3:8333")
    args = parser.parse_args(argv)
    fill(boto3.client("s3", endpoint_url=args.endpoint))
    print(f"s3://{DEMO_BUCKET}/{DEMO_PREFIX}: {DEMO_OBJECTS} objects; s3://{S3_VOLUME_BUCKET}/ for {S3_VOLUME}")


if __name__ == "__main__":
    main()
