#include "server/model/sentencepiece_model.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <mutex>

#include "server/model/sentencepiece_plugin.h"

namespace ttt {
namespace {

constexpr char kPluginFile[] = "libttt_sentencepiece.so";

// The plugin's functions, resolved once per process.
struct Plugin {
  decltype(&ttt_sp_load) load = nullptr;
  decltype(&ttt_sp_free) free = nullptr;
  decltype(&ttt_sp_vocab_size) vocab_size = nullptr;
  decltype(&ttt_sp_adds_dummy_prefix) adds_dummy_prefix = nullptr;
  decltype(&ttt_sp_encode) encode = nullptr;
  decltype(&ttt_sp_decode) decode = nullptr;
  decltype(&ttt_sp_piece_bytes) piece_bytes = nullptr;
  std::string error;
};

// Where the plugin may be: $TTT_SENTENCEPIECE_PLUGIN, beside the executable, in ../lib from it,
// and where the build put it.
std::vector<std::string> PluginCandidates() {
  std::vector<std::string> candidates;
  if (const char* path = std::getenv("TTT_SENTENCEPIECE_PLUGIN")) candidates.push_back(path);
  std::error_code error;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", error);
  if (!error) {
    candidates.push_back((exe.parent_path() / kPluginFile).string());
    candidates.push_back((exe.parent_path() / ".." / "lib" / kPluginFile).string());
  }
  candidates.push_back(TTT_SENTENCEPIECE_PLUGIN_PATH);
  return candidates;
}

const Plugin& GetPlugin() {
  static const Plugin plugin = [] {
    Plugin p;
    void* handle = nullptr;
    for (const std::string& path : PluginCandidates()) {
      if (access(path.c_str(), R_OK) != 0) continue;
      handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
      if (handle != nullptr) break;
      p.error = std::string(path) + ": " + dlerror();
    }
    if (handle == nullptr) {
      if (p.error.empty()) p.error = std::string("cannot find ") + kPluginFile;
      return p;
    }
    auto resolve = [&](auto* function, const char* name) {
      *function =
          reinterpret_cast<std::remove_reference_t<decltype(*function)>>(dlsym(handle, name));
      if (*function == nullptr) p.error = std::string(kPluginFile) + " lacks " + name;
    };
    resolve(&p.load, "ttt_sp_load");
    resolve(&p.free, "ttt_sp_free");
    resolve(&p.vocab_size, "ttt_sp_vocab_size");
    resolve(&p.adds_dummy_prefix, "ttt_sp_adds_dummy_prefix");
    resolve(&p.encode, "ttt_sp_encode");
    resolve(&p.decode, "ttt_sp_decode");
    resolve(&p.piece_bytes, "ttt_sp_piece_bytes");
    return p;
  }();
  return plugin;
}

}  // namespace

SentencePieceModel::~SentencePieceModel() {
  if (model_ != nullptr) GetPlugin().free(model_);
}

std::unique_ptr<SentencePieceModel> SentencePieceModel::Load(const std::string& path,
                                                             std::string* error) {
  const Plugin& plugin = GetPlugin();
  if (!plugin.error.empty()) {
    *error = "SentencePiece support is unavailable: " + plugin.error;
    return nullptr;
  }
  char message[512] = "";
  TttSpModel* model = plugin.load(path.c_str(), message, sizeof message);
  if (model == nullptr) {
    *error = message;
    return nullptr;
  }
  auto wrapper = std::unique_ptr<SentencePieceModel>(new SentencePieceModel());
  wrapper->model_ = model;
  wrapper->vocab_size_ = plugin.vocab_size(model);
  wrapper->adds_dummy_prefix_ = plugin.adds_dummy_prefix(model) != 0;
  // Every piece's bytes, once: detokenizing is then a table lookup.
  for (int32_t id = 0; id < wrapper->vocab_size_; ++id) {
    char bytes[256];
    const int64_t n = plugin.piece_bytes(model, id, bytes, sizeof bytes);
    if (n <= static_cast<int64_t>(sizeof bytes)) {
      wrapper->piece_bytes_.emplace_back(bytes, n);
    } else {
      std::string long_piece(n, '\0');
      plugin.piece_bytes(model, id, long_piece.data(), long_piece.size());
      wrapper->piece_bytes_.push_back(std::move(long_piece));
    }
  }
  return wrapper;
}

bool SentencePieceModel::Encode(std::string_view text, std::vector<int32_t>* ids,
                                std::string* error) const {
  const Plugin& plugin = GetPlugin();
  char message[512] = "";
  ids->resize(text.size() + 16);
  int64_t n = plugin.encode(model_, text.data(), text.size(), ids->data(), ids->size(), message,
                            sizeof message);
  if (n > static_cast<int64_t>(ids->size())) {
    ids->resize(n);
    n = plugin.encode(model_, text.data(), text.size(), ids->data(), ids->size(), message,
                      sizeof message);
  }
  if (n < 0) {
    *error = message;
    return false;
  }
  ids->resize(n);
  return true;
}

std::string SentencePieceModel::Decode(const std::vector<int32_t>& ids) const {
  const Plugin& plugin = GetPlugin();
  std::string text(ids.size() * 8 + 16, '\0');
  int64_t n = plugin.decode(model_, ids.data(), ids.size(), text.data(), text.size());
  if (n > static_cast<int64_t>(text.size())) {
    text.resize(n);
    n = plugin.decode(model_, ids.data(), ids.size(), text.data(), text.size());
  }
  text.resize(n);
  return text;
}

std::string SentencePieceModel::PieceBytes(int32_t id) const {
  if (id < 0 || id >= vocab_size_) return "";
  return piece_bytes_[id];
}

}  // namespace ttt
