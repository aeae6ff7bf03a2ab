//! Response bodies: a whole body, or a generation's events as an API streams them. Either holds
//! its connection's [`RequestGuard`], so the connection counts as in a request until the body is
//! sent or dropped.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Body as HttpBody, Frame, SizeHint};

use super::conn::RequestGuard;
use crate::serve::job::{Event, EventReceiver};

/// A response body.
pub struct Body {
    inner: Inner,
    guard: Option<RequestGuard>,
}

enum Inner {
    Full(Option<Bytes>),
    Events(Box<dyn EventSource>),
}

/// Where a streamed body's server-sent events come from.
pub trait EventSource: Send {
    /// The next events to send; `None` when the stream is over.
    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Bytes>>;
}

impl Body {
    /// A whole body.
    pub fn full(bytes: impl Into<Bytes>) -> Body {
        Body { inner: Inner::Full(Some(bytes.into())), guard: None }
    }

    /// The events of a generation, as server-sent events.
    pub fn events(stream: impl EventSource + 'static) -> Body {
        Body { inner: Inner::Events(Box::new(stream)), guard: None }
    }

    /// Keeps `guard` until the body is sent or dropped.
    pub fn hold(&mut self, guard: RequestGuard) {
        self.guard = Some(guard);
    }
}

impl HttpBody for Body {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let frame = match &mut self.inner {
            Inner::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            Inner::Events(stream) => stream.poll_next(cx).map(|b| b.map(|b| Ok(Frame::data(b)))),
        };
        if matches!(frame, Poll::Ready(None)) {
            self.guard = None;
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        matches!(&self.inner, Inner::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            Inner::Full(None) => SizeHint::with_exact(0),
            Inner::Events(_) => SizeHint::default(),
        }
    }
}

/// Sets a generation's cancel flag when dropped, whatever the path: a client that is gone no
/// longer needs its tokens, and a queued request whose client left is not run.
#[derive(Debug)]
pub struct CancelOnDrop(pub Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// A future that completes when the client has gone away.
pub type Gone = Pin<Box<dyn Future<Output = ()> + Send>>;

/// What a stream makes of a generation's events, in one API's shapes.
pub trait Translate: Send {
    /// What the stream opens with (nothing by default).
    fn opening(&mut self) -> Vec<serde_json::Value> {
        Vec::new()
    }

    /// What an event of the generation (never `Started`) adds; after `Done` or `Failed` none
    /// comes.
    fn event(&mut self, e: Event) -> Vec<serde_json::Value>;

    /// The bytes that carry `values` (server-sent events, JSON lines, ...).
    fn frames(&self, values: &[serde_json::Value]) -> Bytes;

    /// What the stream writes after the frames of `Done` (nothing by default; OpenAI's
    /// `data: [DONE]`), in the same write.
    fn closing(&self) -> &'static str {
        ""
    }
}

/// A generation streamed by a [`Translate`]: it ends after `Done` or `Failed`, or when the client
/// goes away; dropping it cancels the generation.
pub struct Translated<T> {
    translate: T,
    events: EventReceiver,
    gone: Gone,
    _cancel: CancelOnDrop,
    opened: bool,
    ended: bool,
}

impl<T: Translate> Translated<T> {
    /// The stream of `events` through `translate`, cancelled through `cancel`.
    pub fn new(translate: T, events: EventReceiver, cancel: CancelOnDrop, gone: Gone) -> Translated<T> {
        Translated { translate, events, gone, _cancel: cancel, opened: false, ended: false }
    }
}

impl<T: Translate> EventSource for Translated<T> {
    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Bytes>> {
        if !std::mem::replace(&mut self.opened, true) {
            let opening = self.translate.opening();
            if !opening.is_empty() {
                return Poll::Ready(Some(self.translate.frames(&opening)));
            }
        }
        while !self.ended {
            let Some(e) = std::task::ready!(poll_event(&mut self.gone, &mut self.events, cx)) else {
                self.ended = true;
                break;
            };
            if matches!(e, Event::Started { .. }) {
                continue;
            }
            self.ended = matches!(e, Event::Done { .. } | Event::Failed(_));
            let closing = if matches!(e, Event::Done { .. }) { self.translate.closing() } else { "" };
            let out = self.translate.event(e);
            if out.is_empty() && closing.is_empty() {
                continue;
            }
            let frames = self.translate.frames(&out);
            let bytes = if closing.is_empty() { frames } else { [frames.as_ref(), closing.as_bytes()].concat().into() };
            return Poll::Ready(Some(bytes));
        }
        Poll::Ready(None)
    }
}

/// The next event of a streamed generation; `None` when it is over or its client went away (the
/// stream then ends, and dropping it cancels the generation).
pub fn poll_event(gone: &mut Gone, events: &mut EventReceiver, cx: &mut Context<'_>) -> Poll<Option<Event>> {
    if gone.as_mut().poll(cx).is_ready() {
        log::info!("client went away mid-stream: cancelling its generation");
        return Poll::Ready(None);
    }
    events.poll_recv(cx)
}

/// Server-sent events, each named for its `type`.
pub fn typed_events(events: &[serde_json::Value]) -> Bytes {
    let mut out = String::new();
    for e in events {
        out.push_str(&format!("event: {}\ndata: {e}\n\n", e["type"].as_str().unwrap_or("message")));
    }
    Bytes::from(out)
}
