"""Data repositories: S3 prefixes linked into a volume's namespace.

A link (``cachefs repo link``, the ``LinkRepo`` command) is metadata: which
directory shows which ``s3://bucket/prefix``, at which endpoint. Importing
(:mod:`.importer`) turns the bucket's listing into inodes whose content is a
*repo slice* (:data:`cachefs.ids.REPO_SLICE_BIT`), one per object version,
so the client, L1, readahead and the cache tier read imported files like
any other: by block keys that can never name stale bytes. Only on a miss
does someone look at S3: :class:`.source.RepoBlocks` asks the metanodes
which object version a repo slice is (``RepoObject``) and fetches exactly
that block's byte range with a ranged GET conditioned on the ETag
(:mod:`.s3`), so a changed object fails loudly instead of serving new bytes
under an old key.

Credentials come the standard AWS way (environment, shared credentials
file, profile) on each machine that reads: they never enter the metadata.
"""
