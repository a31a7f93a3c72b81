"""Models for the tests: our toy transformer, tiny Hugging Face decoders built from configs, and a LLaMA of the
benchmark's 1B size for the GPU tests."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 96


class ToyBlock(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float, graph_break: bool = False):
        super().__init__()
        self.heads = heads
        self.graph_break = graph_break  # a Dynamo graph break between attention and MLP
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.dropout(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        if self.graph_break:  # (Dynamo resumes in a frame inside the block: a graph of its own for each block)
            torch._dynamo.graph_break()
        return x + self.dropout(self.mlp(self.norm2(x)))


class ToyTransformer(nn.Module):
    """A GPT-style decoder: embedding, a ModuleList of blocks, a head tied to the embedding."""

    def __init__(
        self,
        dim: int = 32,
        layers: int = 3,
        heads: int = 4,
        dropout: float = 0.0,
        seq: int = 64,
        graph_break_after: int | None = None,
        break_in_blocks: bool = False,
    ):
        super().__init__()
        self.graph_break_after = graph_break_after  # a Dynamo graph break after this block
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(ToyBlock(dim, heads, dropout, break_in_blocks) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids) + self.pos[: input_ids.shape[1]]
        split = len(self.blocks) if self.graph_break_after is None else self.graph_break_after + 1
        for block in self.blocks[:split]:
            x = block(x)
        if self.graph_break_after is not None:  # outside the loop: Dynamo resumes in a second graph
            torch._dynamo.graph_break()
        for block in self.blocks[split:]:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())  # next-token loss


def seq2seq_model(kind: str, layers: int = 2, dropout: float = 0.0) -> nn.Module:
    """A tiny Hugging Face encoder-decoder of `kind` (t5, bart), `layers` blocks in each stack, the embedding
    shared by both stacks and tied to the head; random weights, no download."""
    from transformers import BartConfig, BartForConditionalGeneration, T5Config, T5ForConditionalGeneration

    if kind == "t5":
        cfg = T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=layers,
            num_decoder_layers=layers,
            num_heads=4,
            dropout_rate=dropout,
            decoder_start_token_id=0,
            pad_token_id=0,
            # (training keeps no cache; T5's would graph-break at torch 2.11, which cannot trace its config's deepcopy)
            use_cache=False,
        )
        return T5ForConditionalGeneration(cfg)
    cfg = BartConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        dropout=dropout,
    )
    cfg._attn_implementation = "eager"
    return BartForConditionalGeneration(cfg)


def hf_model(
    kind: str, layers: int = 2, dropout: float = 0.0, experts: str | None = None, loss_break: bool = False
) -> nn.Module:
    """A tiny Hugging Face model of `kind`, random weights, no download: a causal LM (gpt2, opt, llama, mistral,
    qwen2: its embedding tied to the head; gpt_neox: a fused query-key-value projection; mixtral: MoE, whose `experts` implementation may be forced, e.g.
    "eager"), an encoder-decoder (SEQ2SEQ_KINDS), bert (masked LM, a tied bias under two names), albert (masked
    LM, its layers sharing one layer's weights), an image classifier (VISION_KINDS). GPT-2's loss is in its one
    graph; `loss_break`: as transformers builds it, whose default loss type graph-breaks on a warning (two
    graphs: the model's and the loss's, for tests of a model compiled as several graphs)."""
    from transformers import (
        AutoModelForCausalLM,
        GPT2Config,
        GPTNeoXConfig,
        LlamaConfig,
        MistralConfig,
        OPTConfig,
        Qwen2Config,
    )

    if kind in SEQ2SEQ_KINDS:
        return seq2seq_model(kind, layers, dropout)
    if kind in VISION_KINDS:
        return vision_model(kind, layers, dropout)
    if kind in ("bert", "albert", "mixtral"):
        return _more_hf_model(kind, layers, dropout, experts)
    if kind == "gpt2":
        cfg = GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=layers,
            n_head=4,
            n_positions=64,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
        )
    elif kind == "opt":
        cfg = OPTConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=layers,
            num_attention_heads=4,
            ffn_dim=64,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
            dropout=dropout,
        )
    elif kind in ("llama", "mistral", "qwen2", "gpt_neox"):
        sizes = dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=layers,
            num_attention_heads=4,
            max_position_embeddings=64,
        )
        if kind == "llama":
            cfg = LlamaConfig(**sizes, num_key_value_heads=2, attention_dropout=dropout)
        elif kind == "mistral":
            cfg = MistralConfig(**sizes, num_key_value_heads=2, attention_dropout=dropout, sliding_window=16)
        elif kind == "qwen2":
            cfg = Qwen2Config(**sizes, num_key_value_heads=2, tie_word_embeddings=True)
        else:
            cfg = GPTNeoXConfig(**sizes, use_cache=False)
    else:
        raise ValueError(f"unknown model kind {kind!r}")
    # (GPT-NeoX under SDPA, with no cache, makes its attention mask in the first block; every block reads it)
    cfg._attn_implementation = "sdpa" if kind == "gpt_neox" else "eager"
    model = AutoModelForCausalLM.from_config(cfg)
    if kind == "gpt2" and not loss_break:  # (GPT2LMHeadModel's name maps to no loss type: a warning, a break)
        model.loss_type = "ForCausalLM"
    return model


def _more_hf_model(kind: str, layers: int, dropout: float, experts: str | None) -> nn.Module:
    from transformers import (
        AlbertConfig,
        AlbertForMaskedLM,
        AutoModelForCausalLM,
        BertConfig,
        BertForMaskedLM,
        MixtralConfig,
    )

    if kind in ("albert", "bert"):  # (albert: one layer's weights, shared by its `layers` layers)
        sizes = dict(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=layers,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
            hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=dropout,
        )
        cfg = AlbertConfig(embedding_size=16, **sizes) if kind == "albert" else BertConfig(**sizes)
        cfg._attn_implementation = "eager"
        return AlbertForMaskedLM(cfg) if kind == "albert" else BertForMaskedLM(cfg)
    cfg = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        attention_dropout=dropout,
    )
    cfg._attn_implementation = "eager"
    if experts is not None:
        cfg._experts_implementation = experts
    return AutoModelForCausalLM.from_config(cfg)


def vision_model(kind: str, layers: int = 2, dropout: float = 0.0) -> nn.Module:
    """A tiny Hugging Face image classifier of `kind` (swin: `layers` stages of two windowed-attention blocks, the
    stages the block list) for IMAGE_SIZE images and LABELS classes; random weights, no download."""
    from transformers import SwinConfig, SwinForImageClassification

    assert kind == "swin", kind
    cfg = SwinConfig(
        image_size=IMAGE_SIZE,
        patch_size=4,
        embed_dim=16,
        depths=[2] * layers,
        num_heads=[2] * layers,
        window_size=4,
        num_labels=LABELS,
        # (as the first loss would set it: a config changed by the first step fails Dynamo's guards, a recompile)
        problem_type="single_label_classification",
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    cfg._attn_implementation = "eager"
    return SwinForImageClassification(cfg)


MODEL_KINDS = ("toy", "gpt2", "opt", "llama", "mistral")
SEQ2SEQ_KINDS = ("t5", "bart")  # encoder-decoders: a block list in each stack
VISION_KINDS = ("swin",)  # image classifiers: pixel values in, a label per image
IMAGE_SIZE, LABELS = 32, 5


def build(kind: str, seed: int = 0, checkpointed: bool = False, **kw) -> nn.Module:
    """`checkpointed`: a Hugging Face model that checkpoints its own layers (`gradient_checkpointing_enable`)."""
    torch.manual_seed(seed)
    model = ToyTransformer(**kw) if kind == "toy" else hf_model(kind, **kw)
    if checkpointed:
        model.gradient_checkpointing_enable()
    return model


def batch(kind: str, batch_size: int = 2, seq: int = 16, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if kind in VISION_KINDS:
        pixels = torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g)
        return {"pixel_values": pixels, "labels": torch.randint(0, LABELS, (batch_size,), generator=g)}
    ids = torch.randint(0, VOCAB, (batch_size, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def loss_of(kind: str, out) -> torch.Tensor:
    return out if kind == "toy" else out.loss


def big_llama(hidden: int = 2048, layers: int = 16) -> nn.Module:
    """A LLaMA on the GPU in bf16 (sdpa attention, 32000 tokens, random weights): with the defaults the ~1B model
    of the benchmark."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,  # 2048 -> 5632: the ~1B model of the benchmark
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128,
        max_position_embeddings=1024,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).cuda().to(torch.bfloat16)


def llama4() -> nn.Module:
    """A 4-layer LLaMA, hidden 64 (eager attention): chunks whose host AdamW weighs against a block's recompute
    (tests/test_replan.py)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    cfg._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(cfg)


def samples_of_many_lengths(seed: int, count: int = 13) -> list[dict[str, list[int]]]:
    """`count` token sequences of lengths between 5 and 59 (distinct, in random order), each its own labels, as a
    data collator takes them."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for length in random.Random(seed).sample(range(5, 60), count):
        ids = torch.randint(2, VOCAB, (length,), generator=g).tolist()
        samples.append({"input_ids": ids, "attention_mask": [1] * length, "labels": ids})
    return samples
