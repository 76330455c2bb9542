"""The demo bucket of the lab's data repository link (``lab up --s3``, and the compose file's ``s3-demo`` job).

    python -m cachefs.lab.s3demo --endpoint http://s3:8333

Puts ``DEMO_OBJECTS`` JPEG-sized objects in class folders under
``s3://demo/train/`` with the credentials of the environment (the standard
AWS chain), creating the bucket first; running it again puts the same keys.
"""

from __future__ import annotations

import argparse
import secrets
from typing import Any

DEMO_BUCKET = "demo"
DEMO_PREFIX = "train/"
DEMO_OBJECTS = 30


def fill(client: Any) -> None:
    """Create the demo bucket (if missing) and put its objects, with a boto3 S3 ``client``."""
    try:
        client.create_bucket(Bucket=DEMO_BUCKET)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    for i in range(DEMO_OBJECTS):
        body = secrets.token_bytes(20_000 + 977 * i)
        client.put_object(Bucket=DEMO_BUCKET, Key=f"{DEMO_PREFIX}class{i % 3}/img{i:03d}.jpg", Body=body)


def main(argv: list[str] | None = None) -> None:
    import boto3

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", required=True, help="the S3 endpoint URL, e.g. http://s3:8333")
    args = parser.parse_args(argv)
    fill(boto3.client("s3", endpoint_url=args.endpoint))
    print(f"s3://{DEMO_BUCKET}/{DEMO_PREFIX}: {DEMO_OBJECTS} objects")


if __name__ == "__main__":
    main()
