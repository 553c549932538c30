// The C interface of the SentencePiece plugin (libttt_sentencepiece.so).
//
// Debian's libsentencepiece embeds its own protobuf-lite (3.14) and exports its symbols, which
// clash with the libprotobuf (3.21) that gRPC needs in the same process, whichever comes first. So
// libsentencepiece is only ever loaded inside this plugin, opened with dlopen(RTLD_LOCAL |
// RTLD_DEEPBIND): its protobuf stays private to it. Nothing else links libsentencepiece.
#pragma once

#include <stddef.h>
#include <stdint.h>

extern "C" {

struct TttSpModel;

// nullptr on failure, with a message in `error`.
TttSpModel* ttt_sp_load(const char* path, char* error, size_t error_size);
void ttt_sp_free(TttSpModel* model);
int32_t ttt_sp_vocab_size(const TttSpModel* model);
// Whether encoding adds a leading space (add_dummy_prefix).
int ttt_sp_adds_dummy_prefix(const TttSpModel* model);
// These write at most `capacity` items and return how many there are (call again with a larger
// buffer when that is more than capacity); encode returns -1 on failure, with a message.
int64_t ttt_sp_encode(const TttSpModel* model, const char* text, size_t length, int32_t* ids,
                      size_t capacity, char* error, size_t error_size);
int64_t ttt_sp_decode(const TttSpModel* model, const int32_t* ids, size_t count, char* text,
                      size_t capacity);
// The text bytes piece `id` stands for: '▁' becomes ' ', a byte piece <0xAB> its byte, control
// pieces nothing, unknown pieces the " ⁇ " sentencepiece's decoder writes.
int64_t ttt_sp_piece_bytes(const TttSpModel* model, int32_t id, char* bytes, size_t capacity);

}  // extern "C"
