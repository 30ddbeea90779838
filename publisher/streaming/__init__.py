"""Streaming quantization: the library path's output, bit for bit, with one tensor in memory at a time.

Modules, in the order data flows: ``job`` (what the engine is asked to do: ``StreamJob``, and the observer / sink /
input protocols it reports to), ``layout`` (every output name, dtype, shape, shard and offset, planned before any weight is read),
``shards`` (where input tensors are read: a local folder or HTTP range reads of a Hub repo),
``safetensors_io`` (headers, plain reads and writes), ``engine`` (the read/quantize/write loop) and
``convert`` (the entry points below). The libraries' own loaders and quantizers on a meta-device model, one adapter
class per library, are publisher/adapters'.
"""

from publisher.streaming.convert import StreamResult, stream_quantize, stream_quantize_many, supports
from publisher.streaming.streamjob import FolderInputs, FolderSink, OutputSink, ShardInputs, StreamJob, TensorObserver

__all__ = ["FolderInputs", "FolderSink", "OutputSink", "ShardInputs", "StreamJob", "StreamResult", "TensorObserver",
           "supports", "stream_quantize", "stream_quantize_many"]
