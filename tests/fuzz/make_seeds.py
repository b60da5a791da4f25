#!/usr/bin/env python3
"""Writes the seed corpora in tests/fuzz/corpus/ (small, valid-ish inputs).

Run once after changing a format; the seeds are checked in. Hand-encodes the
formats (KVCS statistics, KVCALSS1 state files, protobuf wire, safetensors)
so it needs nothing beyond the standard library.
"""
import json
import os
import random
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def put(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def fnv1a64(data):
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


# ---- kernels/statistics.h, format version 1 --------------------------------
def bin_of(x, log2b):
    """HistogramBin for a finite float (kernels/element_math.h)."""
    a = abs(x)
    if a == 0:
        return 0
    bits = struct.unpack("<I", struct.pack("<f", a))[0]
    exp = (bits >> 23) - 127
    if exp < -24:
        return 1
    if exp >= 24:
        return 2 + 48 * (1 << log2b)
    mant_top = (bits & 0x7FFFFF) >> (23 - log2b) if log2b else 0
    return 2 + (exp + 24) * (1 << log2b) + mant_top


def statistics(layers, q, kv, dim, bins, mask, values):
    """values: {(head index): [(batch, float), ...]}."""
    log2b = bins.bit_length() - 1 if bins else 0
    out = struct.pack("<8I", 0x5343564B, 1, layers, q, kv, dim, bins, mask)
    heads = 0
    for r in range(3):
        if mask >> r & 1:
            heads += q if r == 0 else kv
    heads *= layers
    for h in range(heads):
        vals = [(b, struct.unpack("<f", struct.pack("<f", v))[0])
                for b, v in values.get(h, [])]
        fin = [v for _, v in vals]
        mn = min(fin) if fin else float("inf")
        mx = max(fin) if fin else float("-inf")
        out += struct.pack("<ffQQQdd", mn, mx, len(fin), 0, 0, sum(fin),
                           sum(v * v for v in fin))
        if bins:
            hist = {}
            for v in fin:
                hist[bin_of(v, log2b)] = hist.get(bin_of(v, log2b), 0) + 1
            out += struct.pack("<I", len(hist))
            for b in sorted(hist):
                out += struct.pack("<IQ", b, hist[b])
            tail = sorted((abs(v) for v in fin), reverse=True)[:256]
            out += struct.pack("<I", len(tail))
            for v in tail:
                out += struct.pack("<f", v)
        batches = {}
        for b, v in vals:
            lo, hi = batches.get(b, (v, v))
            batches[b] = (min(lo, v), max(hi, v))
        out += struct.pack("<I", len(batches))
        for b in sorted(batches):
            out += struct.pack("<Qff", b, *batches[b])
    return out + struct.pack("<Q", fnv1a64(out))


# ---- protobuf wire ----------------------------------------------------------
def varint(n):
    out = b""
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def field_varint(num, n):
    return varint(num << 3) + varint(n)


def field_bytes(num, data):
    if isinstance(data, str):
        data = data.encode()
    return varint(num << 3 | 2) + varint(len(data)) + data


def session_state(layers, q, kv, dim, bins, roles, stats, producers=(),
                  imports=(), version=1):
    m = field_bytes(1, "s1")
    m += field_varint(2, layers) + field_varint(3, q) + field_varint(4, kv)
    m += field_varint(5, dim) + field_varint(6, bins)
    for r in roles:
        m += field_varint(7, r)
    m += field_bytes(8, stats)
    m += field_varint(9, 3) + field_varint(10, 12) + field_varint(11, 48)
    for name, seq in producers:
        m += field_bytes(13, field_bytes(1, name) + field_varint(2, seq))
    for i in imports:
        m += field_bytes(14, i)
    m += field_varint(15, version)
    return m


def state_file(payload):
    return (b"KVCALSS1" + struct.pack("<QQ", len(payload), fnv1a64(payload)) +
            payload)


# ---- safetensors ------------------------------------------------------------
def safetensors(tensors, metadata=None):
    header, data = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape, payload in tensors:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(payload)]}
        data += payload
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    return struct.pack("<Q", len(h)) + h + data


def main():
    rng = random.Random(5)
    # fuzz_chunk_accumulate: the decoder is structured, random bytes do.
    for i in range(8):
        put("fuzz_chunk_accumulate", f"random-{i}",
            bytes(rng.randrange(256) for _ in range(16 + 48 * i)))

    # fuzz_state: mode byte, then the input.
    small = statistics(1, 2, 1, 2, 1, 0b111,
                       {0: [(0, 0.5), (0, -1.25), (1, 3.0)], 2: [(2, 0.0)],
                        3: [(0, 1e-30), (0, 7e30)]})
    nohist = statistics(2, 1, 1, 1, 0, 0b010, {1: [(5, -2.0), (6, 4.0)]})
    empty = statistics(1, 1, 1, 1, 4, 0b001, {})
    put("fuzz_state", "stats-small", b"\0" + small)
    put("fuzz_state", "stats-nohist", b"\0" + nohist)
    put("fuzz_state", "stats-empty", b"\0" + empty)
    st = session_state(1, 2, 1, 2, 1, [1, 2, 3], small, [("p", 3)], ["i1"])
    put("fuzz_state", "file-small", b"\1" + state_file(st))
    put("fuzz_state", "file-nohist",
        b"\1" + state_file(session_state(2, 1, 1, 1, 0, [2], nohist)))
    put("fuzz_state", "proto-small", b"\2" + st)
    put("fuzz_state", "proto-empty",
        b"\2" + session_state(1, 1, 1, 1, 4, [1], empty, [("a", 1), ("b", 9)]))

    # fuzz_safetensors
    f32 = struct.pack("<4f", 0.5, -1.0, 2.0, 3.5)
    put("fuzz_safetensors", "two-tensors",
        safetensors([("model.layers.0.self_attn.k_scale", "F32", [1],
                      f32[:4]),
                     ("w", "BF16", [2, 3], bytes(range(12)))],
                    {"format": "pt"}))
    put("fuzz_safetensors", "empty-tensor",
        safetensors([("z", "F16", [0, 4], b""), ("a", "F32", [4], f32)]))
    put("fuzz_safetensors", "no-tensors", safetensors([]))
    put("fuzz_safetensors", "i8-u64",
        safetensors([("i", "I8", [3], b"\1\2\3"),
                     ("u", "U64", [1], struct.pack("<Q", 7))]))

    # fuzz_model_config
    llama = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
             "num_attention_heads": 32, "num_hidden_layers": 32,
             "num_key_value_heads": 8, "torch_dtype": "bfloat16"}
    put("fuzz_model_config", "llama.json", json.dumps(llama, indent=2))
    put("fuzz_model_config", "head-dim.json",
        json.dumps({"num_hidden_layers": 4, "num_attention_heads": 8,
                    "head_dim": 128, "hidden_size": 1000}))
    put("fuzz_model_config", "text-config.json",
        json.dumps({"model_type": "llava", "text_config": llama}))
    put("fuzz_model_config", "bad-values.json",
        json.dumps({"num_hidden_layers": -1, "num_attention_heads": 3.5,
                    "num_key_value_heads": None, "head_dim": "64"}))

    # fuzz_checkpoint_index
    s1 = "model-00001-of-00002.safetensors"
    s2 = "model-00002-of-00002.safetensors"
    wm = {f"model.layers.{l}.self_attn.{r}_scale": (s1 if l == 0 else s2)
          for l in range(2) for r in "qkv"}
    wm["model.layers.0.self_attn.o_proj.weight"] = s1
    wm["model.layers.1.self_attn.o_proj.weight"] = s2
    index = {"metadata": {"total_size": 40}, "weight_map": wm}
    put("fuzz_checkpoint_index", "index.json", json.dumps(index, indent=2))
    put("fuzz_checkpoint_index", "index-missing.json",
        json.dumps({"weight_map": {"model.layers.0.self_attn.k_scale": s1,
                                   "gone": "model-00003-of-00003.safetensors",
                                   "num": 3}}))
    shard2 = safetensors(
        [("model.layers.1.self_attn.k_proj.k_scale", "F32", [1], f32[:4]),
         ("model.layers.1.self_attn.v_proj.output_scale", "BF16", [2, 1, 1],
          b"\x80\x3f\x00\x40"),
         ("model.layers.1.self_attn.q_scale", "F16", [1], b"\x00\x3c")])
    put("fuzz_checkpoint_index", "index-with-shard",
        json.dumps(index).encode() + b"\n#shard\n" + shard2)
    # Regressions. A layer number beyond uint32 made std::stoul throw (an
    # uncaught exception, so a crash) in InspectCheckpoint.
    huge = safetensors([("model.layers.99999999999999999999.self_attn.k_scale",
                         "F32", [1], f32[:4])])
    put("fuzz_checkpoint_index", "regress-layer-beyond-uint32",
        json.dumps(index).encode() + b"\n#shard\n" + huge)
    # Shard names outside the checkpoint were opened (and the patcher would
    # rewrite them): now refused before anything is opened.
    put("fuzz_checkpoint_index", "regress-shard-outside-checkpoint",
        json.dumps({"weight_map": {
            "a": "../model-00001-of-00002.safetensors",
            "b": "/proc/self/environ", "c": ".", "d": "..", "e": "",
            "f": s1}}))


if __name__ == "__main__":
    main()
