use super::*;

fn lost(endpoint: &str) -> ggml_sys::Error {
    ggml_sys::Error::RpcLost { endpoint: endpoint.into() }
}

#[test]
fn a_lost_worker_is_named_from_every_layer_that_can_lose_one() {
    let cases = [
        LaunchError::Model(GenerateError::from(lost("a:1"))),
        LaunchError::Split(ScaleError::Worker(lost("a:1"))),
        LaunchError::Split(ScaleError::Budget(BudgetError::Llama(lost("a:1")))),
        LaunchError::Budget(BudgetError::Llama(lost("a:1"))),
        LaunchError::Stream(StreamError::Generate(GenerateError::from(lost("a:1")))),
    ];
    for e in &cases {
        assert_eq!(e.lost_worker(), Some("a:1"), "{e:?}");
        assert!(!e.is_cancelled(), "{e:?}");
    }
    let other = [
        LaunchError::Model(GenerateError::EmptyPrompt),
        LaunchError::Split(ScaleError::WithGpu),
        LaunchError::Stream(StreamError::Graph("x".into())),
    ];
    for e in &other {
        assert_eq!(e.lost_worker(), None, "{e:?}");
    }
}

#[test]
fn a_cancel_is_told_apart_from_a_failure() {
    let interrupted = stream::ReadFailure {
        what: "expert 0 of layer 0".into(),
        path: "m.gguf".into(),
        offset: 0,
        cause: std::io::Error::from(std::io::ErrorKind::Interrupted),
    };
    assert!(LaunchError::Model(GenerateError::Cancelled).is_cancelled());
    assert!(LaunchError::Model(GenerateError::from(ggml_sys::Error::Aborted)).is_cancelled());
    assert!(LaunchError::Stream(StreamError::Generate(GenerateError::Cancelled)).is_cancelled());
    assert!(LaunchError::Stream(StreamError::Read(interrupted)).is_cancelled());
    assert!(!LaunchError::Stream(StreamError::Graph("x".into())).is_cancelled());
    assert!(!LaunchError::Model(GenerateError::EmptyPrompt).is_cancelled());
}
