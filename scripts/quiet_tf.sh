# Sourced by the scripts: keep TensorFlow's start-up notices (oneDNN, absl, CPU features) out
# of hvdsync's output. TF_ENABLE_ONEDNN_OPTS=0 is the only switch that silences the oneDNN
# notice; it turns TensorFlow's oneDNN CPU kernels off (numerics may differ in the last bits).
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
export TF_ENABLE_ONEDNN_OPTS=${TF_ENABLE_ONEDNN_OPTS:-0}
