#include "server/engine/state_layout.h"

namespace ttt {

StateLayout::StateLayout(const ModelConfig& c) : num_layers(c.num_hidden_layers) {
  const size_t nh = c.num_attention_heads, f = c.head_dim(), f1 = c.inner_width();
  const size_t K = c.mini_batch_size, D = c.hidden_size, history = c.conv_kernel - 1;
  const bool mlp = c.ttt_layer_type == TttLayerType::kMlp;
  size_t offset = 0;
  auto take = [&](size_t floats) {
    const size_t at = offset;
    offset += floats;
    return at;
  };
  W1 = take(nh * f * f1);
  b1 = take(nh * f1);
  W2 = take(mlp ? nh * f1 * f : 0);
  b2 = take(mlp ? nh * f : 0);
  pending_k = take(nh * K * f);
  pending_g1 = take(nh * K * f1);
  pending_lr = take(nh * K);
  pending_x2 = take(mlp ? nh * K * f1 : 0);
  pending_g2 = take(mlp ? nh * K * f : 0);
  conv_pre = take(c.pre_conv ? history * D : 0);
  conv_qk = take(c.share_qk ? history * D : 0);
  layer_floats = offset;
}

}  // namespace ttt
