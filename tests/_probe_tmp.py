import time
def kprobe(options_list):
    import keras, numpy as np
    import hvdsync.keras as hvd
    from tests.keras_models import mlp, teacher_data, make_optimizer
    hvd.init()
    out = []
    for o in options_list:
        t0 = time.time()
        m = mlp(seed=0)
        x, y = teacher_data(hvd.rank(), 8 * 16)
        opt = hvd.DistributedOptimizer(make_optimizer("momentum", 0.05), **o)
        m.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        ts = []
        cb = keras.callbacks.LambdaCallback(on_train_batch_end=lambda *a, **k: ts.append(time.time()))
        t1 = time.time()
        m.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), cb])
        t2 = time.time()
        out.append(dict(build=round(t1-t0,2), first=round(ts[0]-t1,2), rest=round(ts[-1]-ts[0],2), end=round(t2-ts[-1],2)))
    return out

def kprofile(o):
    import cProfile, pstats, io
    import keras
    import hvdsync.keras as hvd
    from tests.keras_models import mlp, teacher_data, make_optimizer
    hvd.init()
    def one():
        m = mlp(seed=0)
        x, y = teacher_data(hvd.rank(), 2 * 16)
        opt = hvd.DistributedOptimizer(make_optimizer("momentum", 0.05), **o)
        m.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        m.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    one()
    pr = cProfile.Profile(); pr.enable(); one(); pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(60)
    return s.getvalue()
