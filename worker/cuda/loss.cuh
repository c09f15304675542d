// The cross-entropy through the frozen lm_head, a vocabulary chunk at a time
// (worker/src/device/ops/loss.rs).
// Included by kernels.cu, after the families above it.

// ---------------------------------------------------------------------------------------
// Cross-entropy through the frozen lm_head W in one pass over the vocabulary, a chunk at a
// time: per chunk one GEMM writes the logits [n, cw] (ids start..start+cw; bf16 on a GPU,
// f32 accumulation), `ce_fold` folds them into each row's online softmax and turns them
// into P = exp(l − max) in place, and a second GEMM adds P·W_chunk into the row's
// accumulator acc [n, h]. After the last chunk acc/Σexp = Σ_j softmax_j·W_j, and
// `ce_finish` writes the gradient with respect to the rows' input and the loss. One block
// per row. State per row, initialised by the caller: max −inf, Σexp 0, argmax 0, label
// logit 0 (a label outside the vocabulary keeps it), acc 0.

// Fold a chunk into the row's running max, Σexp, argmax (the smallest id of the largest
// logit) and label logit (as stored: the log-sum-exp is of the same values, so a row sure
// of its label has a loss near 0, not the rounding of its largest logit); the logits
// become P = exp(l − new max), rounded as stored, and when the max rose acc (the earlier
// chunks' Σ P·W) is rescaled to the new max, as FlashAttention rescales its output.
__shared__ float ce_fold_shv[32];  // ce_fold_t's (no __shared__ in a template)
__shared__ int ce_fold_shi[32];
template <typename T> __device__ void ce_fold_t(float* run_max, float* run_sum, int* best_i, float* label_logit, float* acc, T* logits, const int* labels, int cw, int start, int h) {
    float* shv = ce_fold_shv;
    int* shi = ce_fold_shi;
    const long row = blockIdx.x;
    T* lr = logits + row * cw;
    float cmax = NEG_INF;
    int cidx = 0x7fffffff;
    for (int j = threadIdx.x; j < cw; j += blockDim.x) {
        const float v = ld(lr, j);
        if (v > cmax || (v == cmax && j < cidx)) { cmax = v; cidx = j; }
    }
    block_argmax(cmax, cidx, shv, shi, &cmax, &cidx);
    const float m_old = run_max[row];
    const float m_new = fmaxf(m_old, cmax);
    const int lab = labels[row];
    float s = 0.0f;
    for (int j = threadIdx.x; j < cw; j += blockDim.x) {
        const float v = ld(lr, j);
        if (start + j == lab) label_logit[row] = v;
        const float p = exp_neg(v - m_new);
        s += p;
        st(lr, j, p);
    }
    s = block_sum(s, shv);
    if (m_new > m_old) {
        const float f = exp_neg(m_old - m_new);
        for (int d = threadIdx.x; d < h; d += blockDim.x) acc[row * h + d] *= f;
    }
    if (threadIdx.x == 0) {
        run_sum[row] = run_sum[row] * exp_neg(m_old - m_new) + s;
        run_max[row] = m_new;
        if (cmax > m_old) best_i[row] = start + cidx;
    }
}
extern "C" __global__ void ce_fold(float* run_max, float* run_sum, int* best_i, float* label_logit, float* acc, float* logits, const int* labels, int cw, int start, int h) {
    ce_fold_t(run_max, run_sum, best_i, label_logit, acc, logits, labels, cw, start, h);
}
extern "C" __global__ void ce_fold_bf16(float* run_max, float* run_sum, int* best_i, float* label_logit, float* acc, unsigned short* logits, const int* labels, int cw, int start, int h) {
    ce_fold_t(run_max, run_sum, best_i, label_logit, acc, logits, labels, cw, start, h);
}

// After the last chunk: dx = scale·(acc/Σexp − W[label]) (written, not accumulated; W
// [vocab, h], bf16 on a GPU, no row for a label outside the vocabulary), the
// cross-entropy max + log Σexp − label logit, and whether the argmax is the label.
template <typename T> __device__ void ce_finish_t(float* dx, float* loss, int* correct, const float* run_max, const float* run_sum, const int* best_i, const float* label_logit, const float* acc, const int* labels, const float* scale, const T* w, int h, int vocab) {
    const long row = blockIdx.x;
    const int lab = labels[row];
    const bool in_vocab = lab >= 0 && lab < vocab;
    const float inv = 1.0f / run_sum[row], sc = scale[row];
    for (int d = threadIdx.x; d < h; d += blockDim.x) {
        const float wl = in_vocab ? ld(w, (long)lab * h + d) : 0.0f;
        dx[row * h + d] = sc * (acc[row * h + d] * inv - wl);
    }
    if (threadIdx.x == 0) {
        loss[row] = run_max[row] + logf(run_sum[row]) - label_logit[row];
        correct[row] = best_i[row] == lab;
    }
}
extern "C" __global__ void ce_finish(float* dx, float* loss, int* correct, const float* run_max, const float* run_sum, const int* best_i, const float* label_logit, const float* acc, const int* labels, const float* scale, const float* w, int h, int vocab) {
    ce_finish_t(dx, loss, correct, run_max, run_sum, best_i, label_logit, acc, labels, scale, w, h, vocab);
}
extern "C" __global__ void ce_finish_bf16(float* dx, float* loss, int* correct, const float* run_max, const float* run_sum, const int* best_i, const float* label_logit, const float* acc, const int* labels, const float* scale, const unsigned short* w, int h, int vocab) {
    ce_finish_t(dx, loss, correct, run_max, run_sum, best_i, label_logit, acc, labels, scale, w, h, vocab);
}
