"""The released D-Attn forward (ByteDance's Vidi, GitHub bytedance/vidi) written out literally from reading
`lmm/dattn/gemma.py`, `lmm/dattn/mistral.py`, `lmm/dattn/xattn.py`, `lmm/dattn/multimodal.py`, `mm_vision/pos.py`,
`mm_vision/pool.py` (both versions), `utils.py` and `mm_layer/norm.py`: its own masks, softmaxes, pooling, position
features and norms; only the projections, the towers, the LLM's norms and MLPs and the rotary tables are the
model's modules. The tests hold our model to it."""

import math

import torch
import torch.nn.functional as F

from dattn_export.modeling.modeling_dattn import apply_rope

from .released_images import select_best_resolution


def rms(x, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def position_embedding(module, length, num_positions):
    """mm_vision/pos.py: fractional positions, sin on even channels and cos on odd, Linear-GELU-Linear."""
    d = module.mlp[0].in_features
    p = torch.arange(length, dtype=torch.float) / (length - 1) * (num_positions - 1)
    div_term = torch.exp(torch.arange(0, d, 2, dtype=torch.float) * -(math.log(10000.0) / d))
    pe = torch.zeros(length, d)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(p[:, None] * div_term), torch.cos(p[:, None] * div_term)
    return module.mlp(pe)


def image_stream(model, pixels):
    """multimodal.py encode_images (one image per sample): features, embeddings and image_attention_mask."""
    m, grid = model.model, model.config.patch_grid
    features = m.mm_vis.vision_model(pixels, output_hidden_states=True).hidden_states[-2]
    features = features[:, 1:] if m.mm_vis.is_clip else features  # mm_vision/clip.py: the patches, not the class
    x = m.mm_rand_norm.weight * rms(m.mm_rand_projector(features.reshape(len(pixels), grid, grid, -1)))
    x = x + rms(position_embedding(m.mm_rand_pos_h, grid, grid))[None, :, None]
    x = x + rms(position_embedding(m.mm_rand_pos_w, grid, grid))[None, None, :]
    x = m.mm_rand_llm_norm.weight * rms(x.flatten(1, 2))
    present = torch.stack([x.abs().sum() for x in pixels]) != 0
    return x, present[:, None].expand(-1, x.shape[1])


def anyres_stream(model, tiles, image_sizes):
    """multimodal.py encode_images, anyres: per sample a thumbnail and tiles, the image's (width, height)."""
    m, config, grid = model.model, model.config, model.config.patch_grid
    size = config.vision_config["image_size"]
    grid_res = [[a * size, b * size] for a, b in config.mm_image_grid_points]  # mm_image_grid_res
    num_positions = grid * max(max(p) for p in config.mm_image_grid_points)
    features = m.mm_vis.vision_model(torch.cat(tiles), output_hidden_states=True).hidden_states[-2]
    features = m.mm_rand_projector(features)
    samples = []
    for feature, image_size in zip(torch.split(features, [len(t) for t in tiles]), image_sizes):
        base = feature[0].reshape(grid, grid, -1)
        base = base + rms(position_embedding(m.mm_rand_pos_h, grid, num_positions))[:, None]
        base = base + rms(position_embedding(m.mm_rand_pos_w, grid, num_positions))[None, :]
        width, height = select_best_resolution(image_size, grid_res)
        num_patch_width, num_patch_height = width // size, height // size
        tiled = feature[1:].view(num_patch_height, num_patch_width, grid, grid, -1).permute(0, 2, 1, 3, 4)
        tiled = tiled.flatten(0, 1).flatten(1, 2)
        tiled = tiled + rms(position_embedding(m.mm_rand_pos_h, tiled.shape[0], num_positions))[:, None]
        tiled = tiled + rms(position_embedding(m.mm_rand_pos_w, tiled.shape[1], num_positions))[None, :]
        samples.append(torch.cat([base.flatten(0, 1), tiled.flatten(0, 1)]))
    x = torch.nn.utils.rnn.pad_sequence(samples, batch_first=True)
    mask = (x.abs().sum(-1) != 0) & (torch.stack([t.abs().sum() for t in tiles]) != 0)[:, None]
    return m.mm_rand_llm_norm.weight * rms(x), mask


def pool_frames(model, x, max_tokens=60000):
    """mm_rand_img_pool on (N, C, g, g): Vidi_7B's conv + bilinear resize; Vidi1.5_9B's zero pad + space_to_depth
    (resized first when the frames hold more than 60000 x pool^2 padded tokens: utils.resize_by_tokens; a test may
    lower the 60000 to pass it with a few tiny frames)."""
    config, pool = model.config, model.config.mm_image_pool_size
    if config.mm_pool_rule == "conv-interpolate":
        x = F.conv2d(x, model.model.mm_rand_img_pool.conv.weight)
        return F.interpolate(x, size=pool, mode="bilinear", align_corners=True)
    n_tokens, max_tokens = x.size(0) * (x.size(-1) + 1) * (x.size(-2) + 1), max_tokens * pool * pool
    new_h = new_w = 28
    if n_tokens > max_tokens:
        b, _, h, w = F.pad(x, (0, 1, 0, 1)).shape
        ratio = math.sqrt(max_tokens / (b * h * w))
        new_h, new_w = max(10, int(h * ratio) - int(h * ratio) % 2), max(10, int(w * ratio) - int(w * ratio) % 2)
    x = F.pad(x, (0, 1, 0, 1), mode="constant", value=0)
    if new_h != 28:
        x = F.interpolate(x, size=(new_h, new_w), mode="bilinear", align_corners=False)
    b, c, h, w = x.shape
    x = x.reshape(b, c, h // pool, pool, w // pool, pool).permute(0, 1, 3, 5, 2, 4)
    return x.reshape(b, c * pool * pool, h // pool, w // pool)


def video_stream(model, frames, max_tokens=60000):
    """multimodal.py encode_video_images: frames per sample (F_i, 3, H, W) -> embeddings and their mask."""
    m, config, grid = model.model, model.config, model.config.patch_grid
    features = m.mm_vis.vision_model(torch.cat(frames), output_hidden_states=True).hidden_states[-2]
    x = features.reshape(len(features), grid, grid, -1).permute(0, 3, 1, 2)
    x = pool_frames(model, x, max_tokens).permute(0, 2, 3, 1)
    x = m.mm_rand_img_norm.weight * rms(m.mm_rand_img_projector(x))
    x = x + rms(position_embedding(m.mm_rand_pos_h, x.shape[1], config.mm_image_pool_size))[None, :, None]
    x = x + rms(position_embedding(m.mm_rand_pos_w, x.shape[2], config.mm_image_pool_size))[None, None, :]
    per_sample = torch.split(x, [len(f) for f in frames], dim=0)
    time = [rms(position_embedding(m.mm_rand_pos_t, len(f), config.mm_time_interval)) for f in per_sample]
    x = torch.nn.utils.rnn.pad_sequence([(f + t[:, None, None]).flatten(0, 2) for f, t in zip(per_sample, time)], True)
    mask = (x.abs().sum(-1) != 0) & (torch.stack([f.abs().sum() for f in frames]) != 0)[:, None]
    return m.mm_rand_llm_norm.weight * rms(x) * mask[..., None], mask


def audio_stream(model, mels, mel_frames):
    """multimodal.py encode_video_audios: log-mel chunks per sample and lengths in mel frames -> embeddings, mask."""
    m, config = model.model, model.config
    features = m.mm_aud.encoder(torch.cat(mels)).last_hidden_state
    pool_ratio = config.audio_config["max_source_positions"] / mels[0].shape[-1]  # / the processor's nb_max_frames
    sizes = [math.floor(n * pool_ratio) for n in mel_frames]
    per_sample = torch.split(features, [len(a) for a in mels], dim=0)
    x = torch.nn.utils.rnn.pad_sequence([f.flatten(0, 1)[:s] for f, s in zip(per_sample, sizes)], batch_first=True)
    x = F.conv1d(x.permute(0, 2, 1), m.mm_rand_aud_pool.weight, stride=config.mm_audio_pool_size).permute(0, 2, 1)
    sizes = [math.floor(s / config.mm_audio_pool_size) for s in sizes]
    x = torch.cat([f[:s] for f, s in zip(x, sizes)], dim=0)
    x = m.mm_rand_aud_norm.weight * rms(m.mm_rand_aud_projector(x))
    per_sample = torch.split(x, sizes, dim=0)
    time = [rms(position_embedding(m.mm_rand_pos_t, len(f), config.mm_time_interval)) for f in per_sample]
    x = torch.nn.utils.rnn.pad_sequence([f + t for f, t in zip(per_sample, time)], batch_first=True)
    mask = (x.abs().sum(-1) != 0) & (torch.stack([a.abs().sum() for a in mels]) != 0)[:, None]
    return m.mm_rand_llm_norm.weight * rms(x) * mask[..., None], mask


def attention(q, k, v, scale, softcap, mask):
    """Softmax attention of (B, H, T, D) queries over (B, Hkv, S, D) keys (repeated as repeat_kv does)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    return torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ v


def feed_forward(layer, x, gemma):
    if gemma:
        return x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def vidi_logits(model, ids, streams=()):
    """The released forward: ids (B, T) without the image token (its embedding is dropped); `streams` the context
    streams as (embeddings, mask): an image, or a video's frames and audio."""
    config, m = model.config, model.model
    gemma = config.model_type == "dattn_gemma2"
    heads = lambda proj, x: proj(x).unflatten(-1, (-1, config.head_dim)).transpose(1, 2)
    normalizer = torch.tensor(config.hidden_size**0.5) if gemma else torch.tensor(1.0)
    h = F.embedding(ids, m.embed_tokens.weight) * normalizer
    streams = [(x * normalizer, mask) for x, mask in streams]
    batch, length = ids.shape
    rope = m.rotary_emb(h, torch.arange(length).expand(batch, -1))
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    for n, layer in enumerate(m.layers):
        attn = layer.self_attn
        scale = (config.query_pre_attn_scalar if gemma else config.head_dim) ** -0.5
        softcap = config.attn_logit_softcapping if gemma else None
        sliding = config.layer_types[n] == "sliding_attention" if gemma else config.sliding_window is not None
        causal = (j <= i) & ((i - j <= config.sliding_window) if sliding else True)  # flash-attn window (w, w)
        x = layer.input_layernorm(h)
        q = heads(attn.q_proj, x)
        k, v = apply_rope(heads(attn.k_proj, x), *rope), heads(attn.v_proj, x)
        out = attn.o_proj(attention(apply_rope(q, *rope), k, v, scale, softcap, causal).transpose(1, 2).flatten(2))
        for s, (stream, mask) in enumerate(streams):  # T2V, T2A: unrotated query, zero for a sample without it
            xs = layer.input_layernorm(stream)
            ks, vs = heads(attn.k_proj, xs), heads(attn.v_proj, xs)
            present = mask.any(-1)[:, None, None]  # xattn: a sample without one sees every key, times 0
            cross = attention(q, ks, vs, scale, softcap, mask[:, None, None, :] | ~present[..., None])
            out = out + attn.o_proj(cross.transpose(1, 2).flatten(2)) * present
            diagonal = attn.o_proj(vs.repeat_interleave(q.shape[1] // vs.shape[1], 1).transpose(1, 2).flatten(2))
            stream = feed_forward(
                layer, stream + (layer.post_attention_layernorm(diagonal) if gemma else diagonal), gemma
            )
            streams[s] = (stream, mask)
        h = feed_forward(layer, h + (layer.post_attention_layernorm(out) if gemma else out), gemma)
    logits = model.lm_head(m.norm(h))
    return config.final_logit_softcapping * torch.tanh(logits / config.final_logit_softcapping) if gemma else logits


def released_answer_ranges(outputs: str, length: float, family: str) -> str:
    """`ask`'s last lines in Vidi_7B/inference.py (mistral) and Vidi1.5_9B/vidi/eval/inference.py (gemma2): the
    answer's fraction ranges as hh:mm:ss of a video of `length` seconds (ffprobe's format=duration)."""
    import re

    pattern = re.compile(r"([\d|\.]+)-([\d|\.]+)" if family == "mistral" else r"(\d\.\d+)-(\d\.\d+)")
    results = pattern.findall(outputs)
    output_list = []
    for result in results:
        t_0 = float(result[0]) * length
        t_1 = float(result[1]) * length
        if family == "mistral":
            output_list.append(
                "{:02d}:{:02d}:{:.2f}-{:02d}:{:02d}:{:.2f}".format(
                    int(t_0 / 3600), (int(t_0) % 3600) // 60, int(t_0) % 60,
                    int(t_1 / 3600), (int(t_1) % 3600) // 60, int(t_1) % 60,
                )
            )  # fmt: skip
        else:
            output_list.append(
                "{:02d}:{:02d}:{:02d}-{:02d}:{:02d}:{:02d}".format(
                    int(t_0 / 3600), (int(t_0) % 3600) // 60, int(t_0) % 60,
                    int(t_1 / 3600), (int(t_1) % 3600) // 60, int(t_1) % 60,
                )
            )  # fmt: skip
    return ", ".join(output_list)
