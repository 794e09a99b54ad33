// Chat templates: render a conversation the way a model family was trained on it, tokenize it,
// and mark what the model must learn to emit. Built-in templates (no Jinja):
//   "llava"   LLaVA-1.5 / Vicuna v1 (conv_vicuna_v1):
//             "<system> USER: <user> ASSISTANT: <reply></s>USER: ..."  (default Vicuna system
//             prompt when there is no system turn; BOS from the tokenizer)
//   "llama2"  Llama-2 chat (Meta / HF chat_template):
//             "<s>[INST] <<SYS>>\n<system>\n<</SYS>>\n\n<user> [/INST] <reply> </s><s>[INST] ..."
//             (user and reply text stripped, as the template does)
//   "llama3"  Llama-3 instruct: "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n
//             <user><|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n<reply><|eot_id|>"
//             (text trimmed)
//   "chatml"  Qwen2: "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user
//             \n<user><|im_end|>\n<|im_start|>assistant\n<reply><|im_end|>\n" (that default
//             system turn when there is none)
//   "plain"   LLaVA pretraining (conv_llava_plain / preprocess_plain): exactly one user turn,
//             reduced to the markers it contains (the image), then "<reply>\n"; BOS from the
//             tokenizer.
// The rendered text is tokenized in one piece with special tokens parsed (as tokenizing
// apply_chat_template's output does), so special-token strings inside turn texts become special
// tokens; the template's own special strings must be single tokens of the tokenizer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "weft/data/text_tokenizer.h"

namespace weft::data {

// role: "system" | "user" | "assistant"; LLaVA's "human" / "gpt" are accepted for user /
// assistant. An optional system turn comes first, then user and assistant alternate, starting
// with the user (a conversation may end with a user turn).
struct ChatTurn {
  std::string role;
  std::string text;
};

// E.g. {"<image>", placeholder id, 576}: each occurrence of `text` in a user or system turn is
// replaced by `count` copies of token_id (not tokenized; the text around it is tokenized as if a
// special token stood there).
struct ChatMarker {
  std::string text;
  int64_t token_id = 0;
  int64_t count = 1;
};

// One marker occurrence: index into the markers, position and length in EncodedChat::ids.
struct MarkerSpan {
  int marker = 0;
  int64_t start = 0;
  int64_t length = 0;
};

struct EncodedChat {
  std::vector<int64_t> ids;
  std::vector<uint8_t> is_target;  // per id
  std::vector<MarkerSpan> spans;   // in order of position
};

// Renders turns with the template and tokenizes. is_target = 1 exactly on the tokens of the
// assistant replies and the template's end-of-turn token(s) after them ("</s>" for llava and
// llama2 (with the space before it), "<|eot_id|>", "<|im_end|>", the "\n" of plain); a token is
// a target when its source text overlaps a reply or its end of turn. 0 elsewhere (system, user,
// role headers, BOS, markers). BOS is added at the start when the template writes one or (llava,
// plain) when the tokenizer's add_bos is set. Errors (weft::Error): unknown template, empty
// turns, unknown role, roles not alternating, a marker in an assistant turn, a template token
// the tokenizer lacks.
EncodedChat encode_chat(const TextTokenizer& tok, const std::string& template_name,
                        const std::vector<ChatTurn>& turns, const std::vector<ChatMarker>& markers);

// The rendered text of encode_chat (markers left as text), for inspection and tests.
std::string render_chat(const std::string& template_name, const std::vector<ChatTurn>& turns,
                        const std::vector<ChatMarker>& markers = {});

}  // namespace weft::data
