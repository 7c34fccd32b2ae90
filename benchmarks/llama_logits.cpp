// llama.cpp's logits and greedy continuations for given token ids, for the GGUF comparison
// (benchmarks/gguf_architectures.py builds this against the libllama that benchmarks/llama_cpp.sh
// builds). No tokenizer and no sampler of llama.cpp's own is involved: both sides get the same ids.
//
//   llama-logits MODEL.gguf THREADS N_GEN LOGITS.bin < prompts.txt
//
// prompts.txt: one prompt a line, its token ids separated by spaces. LOGITS.bin: for each prompt,
// the logits of every prompt position (float32, [positions, vocabulary]), prompts one after another.
// Standard output: one line a prompt, the N_GEN greedy token ids after it.
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

static int argmax(const float * row, int n) {
    int best = 0;
    for (int i = 1; i < n; ++i) {
        if (row[i] > row[best]) best = i;
    }
    return best;
}

static bool decode(llama_context * ctx, const std::vector<llama_token> & ids, int pos0, bool all_logits) {
    llama_batch batch = llama_batch_init((int32_t) ids.size(), 0, 1);
    for (size_t i = 0; i < ids.size(); ++i) {
        batch.token[i] = ids[i];
        batch.pos[i] = pos0 + (int) i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = all_logits || i + 1 == ids.size();
    }
    batch.n_tokens = (int32_t) ids.size();
    const bool ok = llama_decode(ctx, batch) == 0;
    llama_batch_free(batch);
    return ok;
}

int main(int argc, char ** argv) {
    if (argc != 5) {
        std::fprintf(stderr, "usage: %s MODEL.gguf THREADS N_GEN LOGITS.bin < prompts.txt\n", argv[0]);
        return 2;
    }
    const int threads = std::atoi(argv[2]);
    const int n_gen = std::atoi(argv[3]);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        std::fprintf(stderr, "could not load %s\n", argv[1]);
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 512;
    cp.n_batch = 512;
    cp.n_ubatch = 512;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    llama_context * ctx = llama_init_from_model(model, cp);
    FILE * out = std::fopen(argv[4], "wb");
    if (!ctx || !out) {
        std::fprintf(stderr, "could not make a context or open %s\n", argv[4]);
        return 1;
    }
    std::string line;
    while (std::getline(std::cin, line)) {
        std::vector<llama_token> ids;
        std::istringstream words(line);
        for (llama_token t; words >> t;) ids.push_back(t);
        if (ids.empty()) continue;
        llama_memory_clear(llama_get_memory(ctx), true);
        if (!decode(ctx, ids, 0, true)) {
            std::fprintf(stderr, "decode failed\n");
            return 1;
        }
        for (size_t i = 0; i < ids.size(); ++i) {
            std::fwrite(llama_get_logits_ith(ctx, (int32_t) i), sizeof(float), n_vocab, out);
        }
        int pos = (int) ids.size();
        llama_token next = argmax(llama_get_logits_ith(ctx, -1), n_vocab);
        for (int g = 0; g < n_gen; ++g) {
            std::printf(g ? " %d" : "%d", next);
            if (!decode(ctx, {next}, pos++, false)) {
                std::fprintf(stderr, "decode failed\n");
                return 1;
            }
            next = argmax(llama_get_logits_ith(ctx, -1), n_vocab);
        }
        std::printf("\n");
    }
    std::fclose(out);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
