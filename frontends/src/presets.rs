//! GPT / Llama / MoE presets (being written).
