"""Collection (section `collection`, collection.py): what collecting a 16-worker cluster's
history costs, with its load (collection_load.py), its meters (collection_meters.py), and
the client's merge at 16 to 1000 workers (merge_scale.py, run as
`python -m benchmarks.collection.merge_scale`)."""
