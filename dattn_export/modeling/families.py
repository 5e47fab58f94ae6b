"""The LLM families D-Attn models are built on, one registered spec each: every fact that differs between them.

The configs, the reference model, the released-config reader, the presets, the graphs' runtime, genai's config and
the vLLM model all read a family's facts from here; adding a family is one `Family` below, a line naming each class
made from it (in configuration_dattn.py, modeling_dattn.py and the vLLM plugin: grep finds every class by its name),
its transformers modules in modeling_dattn.py's `FAMILY_MODULES`, and its tests. Plain Python, no imports: the CLI
lists the families without importing torch, and the file ships in a Hub repo beside the model files that import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from string import Formatter


@dataclass(frozen=True)
class Family:
    name: str  # the CLI's and the presets' name; the model type is dattn_{name}
    prefix: str  # transformers' class prefix: {prefix}Config, {prefix}RMSNorm, {prefix}MLP, {prefix}RotaryEmbedding
    activation_key: str  # the config field naming the MLP's activation (transformers' own MLP reads it)
    sandwich_norms: bool  # norms after the attention and around the MLP
    embedding_scaled: bool  # the text embeddings times sqrt(hidden) ({prefix}TextScaledWordEmbedding)
    norm_offset: float  # its RMSNorm scales by (offset + weight): weights start at 1 - offset
    window_per_layer: bool  # the sliding window applies to the layers layer_types marks sliding; else to all
    genai_type: str  # onnxruntime-genai's model type
    # the attention projections that always carry a bias (Qwen2: q, k and v); None: q, k, v and o alike, as the
    # config's attention_bias says (false where the family's config has no such field)
    biased_projections: tuple[str, ...] | None = None
    # the released D-Attn model on this family (GitHub bytedance/vidi) and what its code does that configs omit;
    # None: no released model, so no released config to read
    released_model: str | None = None
    released_architecture: str | None = None
    released_pool_rule: str = "space-to-depth"  # how its video model pools (streams.POOL_RULES)
    released_scales_streams: bool = False  # its visual and audio streams times sqrt(hidden), like its text
    # how its inference script turns an answer's "0.12-0.15" (fractions of the video) into hh:mm:ss ranges: the
    # pattern it finds them with (None: no released script to follow), and how it writes the seconds (its minutes
    # and hours are always {:02d})
    released_range_pattern: str | None = None
    released_seconds_format: str = "{:02d}"
    released_extra_fields: dict = field(default_factory=dict)  # keys its saved config.json has beside ours
    # the task its released model was trained on, as its inference script asks it: the user's query (a trailing
    # period cut) in this text, with the video's length in seconds where it has {length}; None: no released task
    released_task: str | None = None
    # the family's chat turns (Jinja, the body of its chat template: `chat_template`) and the special tokens they are
    # written with
    chat_turns: str = ""
    chat_tokens: tuple[str, ...] = ()
    tiny: dict = field(default_factory=dict)  # a tiny text model (presets.py) that exercises the family's features

    @property
    def model_type(self) -> str:
        return f"dattn_{self.name}"

    # the classes made from this entry, each written out by this name (configuration_dattn.py, modeling_dattn.py,
    # the vLLM plugin's serving config): config.json's architectures and a Hub repo's auto_map give these names
    @property
    def config_class_name(self) -> str:
        return f"DAttn{self.prefix}Config"

    @property
    def model_class_name(self) -> str:
        return f"DAttn{self.prefix}ForCausalLM"

    @property
    def chat_template(self) -> str:
        """The family's chat template: its turns, a turn's content as the released scripts write a question (the
        media's marker first), and, where a request asks for it (the template's `task="retrieval"`, with
        `video_length` where the task states it), the released task prompt around the user's text."""
        return CONTENT_TEXT + task_macro(self.released_task) + self.chat_turns

    def projection_has_bias(self, projection: str, attention_bias: bool) -> bool:
        """Whether `projection` (q_proj, k_proj, v_proj, o_proj) has a bias, given the config's attention_bias."""
        if self.biased_projections is None:
            return attention_bias
        return projection in self.biased_projections


# A message's content as text: a string as it is, a list of parts (transformers' and OpenAI's form) as the released
# scripts write a question: the media's one marker and a newline first (a picture, or a video with its sound), then
# the text parts, each on a line of its own. A user's text (`asked`) in the family's task prompt where the request
# asks for the retrieval task (`task_macro`).
CONTENT_TEXT = (
    "{%- macro content_text(content, asked=false) -%}"
    "{%- if content is string -%}"
    "{%- set marker = '<image>\\n' if content.startswith('<image>\\n') else '' -%}"
    "{%- set text = content[marker | length:] -%}"
    "{%- else -%}"
    "{%- set media = content | selectattr('type', 'in', ['image', 'image_url', 'video', 'video_url']) | list -%}"
    "{%- set marker = '<image>\\n' if media else '' -%}"
    "{%- set text = content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('\\n') -%}"
    "{%- endif -%}"
    "{{- marker -}}"
    "{%- if asked and task is defined and task == 'retrieval' -%}{{- task_prompt(text) -}}{%- else -%}{{- text -}}"
    "{%- endif -%}"
    "{%- endmacro -%}"
)


def task_macro(task: str | None) -> str:
    """Jinja: `task_prompt(text)`, the released task prompt (`Family.released_task`, the one source) around a query,
    its trailing period cut; the video's length from the template's `video_length` where the prompt states it."""
    if task is None:
        body = "{{- raise_exception('this model has no released retrieval task') -}}"
    else:
        parts, needs_length = [], False
        for literal, name, spec, _ in Formatter().parse(task):
            parts.append("'" + literal.replace("\\", "\\\\").replace("'", "\\'") + "'")
            if name == "query":
                parts.append("query")
            elif name == "length":
                parts.append(f"('%{spec}' | format(video_length))")
                needs_length = True
        body = "{%- set query = text[:-1] if text.endswith('.') else text -%}"
        if needs_length:
            body += (
                "{%- if video_length is not defined -%}"
                "{{- raise_exception('the retrieval task states the video length: pass video_length (seconds)') -}}"
                "{%- endif -%}"
            )
        body += "{{- " + " ~ ".join(parts) + " -}}"
    return "{%- macro task_prompt(text) -%}" + body + "{%- endmacro -%}"


# Mistral v0.3's instruction turns (Vidi_7B): "[INST] question[/INST]", " answer</s>"; a system message before the
# last question, as Mistral's own template places it
MISTRAL_TURNS = (
    "{{- bos_token -}}"
    "{%- set system = messages | selectattr('role', 'equalto', 'system') | map(attribute='content') | list -%}"
    "{%- set turns = messages | rejectattr('role', 'equalto', 'system') | list -%}"
    "{%- set ns = namespace(last=-1) -%}"
    "{%- for message in turns -%}{%- if message['role'] == 'user' -%}{%- set ns.last = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for message in turns -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- '[INST] ' -}}"
    "{%- if system and loop.index0 == ns.last -%}{{- content_text(system[0]) + '\\n\\n' -}}{%- endif -%}"
    "{{- content_text(message['content'], true) + '[/INST]' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- ' ' + content_text(message['content']) | trim + eos_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

# Gemma 2's turns (Vidi1.5_9B): "<start_of_turn>user\n...<end_of_turn>\n", the model's turn opened to answer
GEMMA2_TURNS = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{- raise_exception('Gemma 2 has no system role') -}}{%- endif -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{- raise_exception('the turns must alternate: user, assistant, user, ...') -}}"
    "{%- endif -%}"
    "{%- set role = 'user' if message['role'] == 'user' else 'model' -%}"
    "{{- '<start_of_turn>' + role + '\\n' + content_text(message['content'], role == 'user') | trim -}}"
    "{{- '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)

# ChatML (Qwen2's instruct models)
CHATML_TURNS = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content_text(message['content'], message['role'] == 'user')"
    " + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

DEFAULT_FAMILY = "mistral"  # the demo's and the presets'

TINY_SIZES = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    max_position_embeddings=2048, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip

FAMILIES = {
    family.name: family
    for family in (
        Family(
            name="mistral",
            prefix="Mistral",
            activation_key="hidden_act",
            sandwich_norms=False,
            embedding_scaled=False,
            norm_offset=0.0,
            window_per_layer=False,
            genai_type="mistral",
            released_model="Vidi_7B",
            released_architecture="DattnMistralForCausalLM",
            released_pool_rule="conv-interpolate",
            released_scales_streams=False,
            released_range_pattern=r"([\d|\.]+)-([\d|\.]+)",  # Vidi_7B/inference.py
            released_seconds_format="{:.2f}",
            released_task=(  # Vidi_7B/inference.py
                "Given the frames from a video, answer the time range in percentage that corresponds to query text "
                "split by comma. Video length is: {length:.2f} and text query is: {query}."
            ),
            chat_turns=MISTRAL_TURNS,
            chat_tokens=("[INST]", "[/INST]"),
            # heads of 32: vLLM's CPU attention has kernels from 32 up, so the demo serves on CPU too
            tiny=dict(TINY_SIZES, num_key_value_heads=2, head_dim=32, sliding_window=None),
        ),
        Family(
            name="gemma2",
            prefix="Gemma2",
            activation_key="hidden_activation",
            sandwich_norms=True,
            embedding_scaled=True,
            norm_offset=1.0,
            window_per_layer=True,
            genai_type="gemma2",
            released_model="Vidi1.5_9B",
            released_architecture="DattnGemma2ForCausalLM",
            released_pool_rule="space-to-depth",
            released_scales_streams=True,
            released_range_pattern=r"(\d\.\d+)-(\d\.\d+)",  # Vidi1.5_9B/vidi/eval/inference.py
            released_seconds_format="{:02d}",
            released_extra_fields={"cache_implementation": "hybrid"},
            released_task="During which time segments in the video can we see {query}?",  # Vidi1.5_9B eval/inference.py
            chat_turns=GEMMA2_TURNS,
            chat_tokens=("<start_of_turn>", "<end_of_turn>"),
            tiny=dict(
                TINY_SIZES,
                num_key_value_heads=1,
                head_dim=32,
                query_pre_attn_scalar=24,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                attn_logit_softcapping=50.0,
                final_logit_softcapping=30.0,
            ),  # fmt: skip
        ),
        Family(  # no released D-Attn model: a family added by this entry (and its class lines)
            name="qwen2",
            prefix="Qwen2",
            activation_key="hidden_act",
            sandwich_norms=False,
            embedding_scaled=False,
            norm_offset=0.0,
            window_per_layer=True,
            genai_type="qwen2",
            biased_projections=("q_proj", "k_proj", "v_proj"),
            chat_turns=CHATML_TURNS,
            chat_tokens=("<|im_start|>", "<|im_end|>"),
            tiny=dict(
                TINY_SIZES,
                num_attention_heads=2,
                num_key_value_heads=1,
                use_sliding_window=True,
                sliding_window=8,
                max_window_layers=1,  # layers from this one on slide: full, sliding, sliding
            ),  # fmt: skip
        ),
    )
}
BY_MODEL_TYPE = {family.model_type: family for family in FAMILIES.values()}
